"""Two agent frameworks, unchanged, against the server and offline: the OpenAI Agents SDK (through
its chat-completions and its Responses model classes) and pydantic-ai (a typed result).

Both talk only to the test server: the Agents SDK's tracing is off, pydantic-ai is not instrumented.
The parallel-call setting is each framework's own, off so that the small model calls once.
"""

from __future__ import annotations

import asyncio

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from pydantic import BaseModel
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

set_tracing_disabled(True)
PydanticAgent.instrument_all(False)


def _run_forecast_agent(srv, model_class, calls: list | None = None) -> tuple[list[tuple[str, int]], str]:
    calls = [] if calls is None else calls

    @function_tool
    def get_forecast(city: str, days: int) -> str:
        """Weather forecast for a city."""
        calls.append((city, days))
        return f"Sunny in {city} for {days} days."

    async def run() -> str:
        client = AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        agent = Agent(
            name="forecaster",
            instructions="You answer weather questions with the get_forecast tool.",
            tools=[get_forecast],
            model=model_class(srv.model, client),
            # Calls once (required), then answers with tool_choice reset to auto.
            model_settings=ModelSettings(
                tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=100
            ),
        )
        result = await Runner.run(agent, "Forecast for Tokyo, 5 days?", max_turns=3)
        return result.final_output

    return calls, asyncio.run(run())


def test_openai_agents_with_chat_completions(smol_tools):
    calls, answer = _run_forecast_agent(smol_tools, OpenAIChatCompletionsModel)
    assert calls == [("Tokyo", 5)] and "Sunny in Tokyo" in answer


def test_openai_agents_with_responses(smol_tools):
    calls, answer = _run_forecast_agent(smol_tools, OpenAIResponsesModel)
    assert calls == [("Tokyo", 5)] and "Sunny in Tokyo" in answer


class City(BaseModel):
    name: str
    country: str


def test_pydantic_ai_typed_result(smol_tools, smol_async):
    # With the Hermes template (its own format), and with SmolLM2's, which ignores tools (the JSON list).
    for srv in (smol_tools, smol_async):
        model = OpenAIChatModel(srv.model, provider=OpenAIProvider(base_url=f"{srv.url}/v1", api_key="unused"))
        settings = {"temperature": 0, "max_tokens": 60, "parallel_tool_calls": False}
        agent = PydanticAgent(model, output_type=City, model_settings=settings)
        result = agent.run_sync("What is the capital of France?")
        assert isinstance(result.output, City) and result.output.name == "Paris", result.output


def test_openai_agents_on_a_template_that_ignores_tools(smol_auto):
    """SmolLM2's own template with --enable-auto-tool-choice --tool-call-parser hermes: the SDK's
    follow-up turns (tool_choice reset to auto, the tool result in the history) are served too. The
    small model copies its call on each turn rather than answer, and the run ends at its turn limit;
    a refused turn would raise the SDK's BadRequestError instead."""
    for model_class in (OpenAIChatCompletionsModel, OpenAIResponsesModel):
        calls: list[tuple[str, int]] = []
        answer = ""
        try:
            _, answer = _run_forecast_agent(smol_auto, model_class, calls)
        except MaxTurnsExceeded:
            pass
        assert calls[:1] == [("Tokyo", 5)] and (answer or len(calls) == 3), (model_class, calls)
