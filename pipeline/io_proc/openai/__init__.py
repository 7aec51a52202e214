"""The OpenAI API: its schema, the serving classes, the Responses API, SSE framing and log-probability JSON."""
