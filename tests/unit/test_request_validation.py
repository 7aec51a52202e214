"""Limits that keep a bad request from reaching the device: start-up flags and prompt token ids."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import save_file

from pipeline.common.config import EngineConfig
from pipeline.io_proc.openai.protocol import APIError
from pipeline.io_proc.openai.protocol_completion import CompletionRequest
from pipeline.io_proc.openai.serving import OpenAIServing
from pipeline.server_args import build_parser
from pipeline.server_config import make_config


@pytest.fixture()
def model_dir(tmp_path):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "max_position_embeddings": 512,
        "vocab_size": 300,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({}, tmp_path / "model.safetensors")  # start-up checks the weights file is there, not its tensors
    (tmp_path / "tokenizer.json").write_text("{}")  # and that the tokenizer's file is there
    return tmp_path


def test_max_model_len_past_max_position_embeddings_is_a_start_up_error(model_dir, capsys):
    args = build_parser().parse_args(["--model", str(model_dir), "--max-model-len", "1024", "--num-kv-blocks", "100"])
    with pytest.raises(SystemExit) as e:
        make_config(args)
    assert e.value.code == 2
    assert "--max-model-len 1024 exceeds the model's max_position_embeddings 512" in capsys.readouterr().err


def test_config_carries_the_model_vocabulary(model_dir):
    config = make_config(
        build_parser().parse_args(["--model", str(model_dir), "--num-kv-blocks", "100", "--device", "cpu"])
    )
    shutil.rmtree(config.ipc_dir)
    assert config.max_model_len == 512 and config.vocab_size == 300


class _Tokenization:
    vocab_size = 1000  # the tokenizer knows more ids than the model has rows for
    renders_tools = renders_tool_calls = False
    system_role = tool_role = True

    @staticmethod
    def max_prompt_chars(max_tokens: int) -> int:
        return 100 * max_tokens


class _Client:
    def add_choices(self, prompt, params, stops, streaming, return_token_ids, n):
        self.params = params
        return [("added", prompt)] * n


def test_prompt_ids_are_checked_against_the_model_vocabulary():
    config = EngineConfig(model="m", served_model_name="m", max_model_len=64, vocab_size=300)
    serving = OpenAIServing(config, _Client(), _Tokenization(), stop_token_ids=())
    with pytest.raises(APIError) as e:
        serving._sampling_params(CompletionRequest(prompt=[5, 300], max_tokens=2), [5, 300], "prompt")
    assert e.value.status_code == 400 and e.value.param == "prompt"
    assert "prompt token id 300 is out of range: the vocabulary has 300 tokens" in e.value.message
    req = CompletionRequest(prompt=[5, 299], max_tokens=2)
    assert serving._start(req, [5, 299], serving._sampling_params(req, [5, 299], "prompt")) == [("added", [5, 299])]


def test_max_completion_tokens_wins_on_completions():
    config = EngineConfig(model="m", served_model_name="m", max_model_len=64, vocab_size=300)
    client = _Client()
    serving = OpenAIServing(config, client, _Tokenization(), stop_token_ids=())
    req = CompletionRequest(prompt=[5], max_tokens=9, max_completion_tokens=3, user="someone")
    serving._start(req, [5], serving._sampling_params(req, [5], "prompt"))
    assert client.params.max_tokens == 3
    with pytest.raises(ValueError, match="max_completion_tokens"):
        CompletionRequest(prompt=[5], max_completion_tokens=0)
