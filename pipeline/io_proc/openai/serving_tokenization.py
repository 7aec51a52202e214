"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes)."""

from __future__ import annotations

from starlette.responses import Response

from pipeline.io_proc.openai.protocol import APIError
from pipeline.io_proc.openai.protocol_tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pipeline.io_proc.openai.serving import OpenAIServing, json_response


class OpenAIServingTokenization(OpenAIServing):
    """The tokenizer endpoints' logic (arguments as ``OpenAIServing``)."""

    async def tokenize(self, req: TokenizeRequest) -> Response:
        """Serve ``POST /tokenize`` (vLLM's shape): the ids a prompt or a conversation encodes to.

        Raises:
            APIError: 404 unknown model, 400 too long a text or a template error.
        """
        self._check_model(req)
        if req.prompt is not None:
            self._check_chars(len(req.prompt), "prompt")
            ids = await self._tokenization.encode_text(req.prompt, req.add_special_tokens)
        else:
            self._check_chars(sum(len(m.text()) for m in req.messages), "messages")
            conversation = self.tool_calling.conversation(req.messages)
            ids = await self._tokenization.encode_chat(conversation, req.add_generation_prompt)
        return json_response(TokenizeResponse(count=len(ids), max_model_len=self._max_model_len, tokens=ids))

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        """Serve ``POST /detokenize`` (vLLM's shape): the text of token ids.

        Raises:
            APIError: 404 unknown model, 400 an id outside the vocabulary.
        """
        self._check_model(req)
        if req.tokens and max(req.tokens) >= self._vocab_limit:
            raise APIError.bad_request(
                f"token id {max(req.tokens)} is out of range: the vocabulary has {self._vocab_limit} tokens",
                param="tokens",
            )
        return json_response(DetokenizeResponse(prompt=await self._tokenization.decode(req.tokens)))
