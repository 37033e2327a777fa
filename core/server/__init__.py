"""OpenAI-compatible HTTP server over one engine thread.

``protocol`` request schemas · ``errors`` OpenAI-style error bodies · ``async_engine`` the engine
thread bridge · ``submission`` request fields → engine requests · ``streaming`` SSE with disconnect
handling · ``logprobs`` token strings and logprob rendering · ``openai_api`` / ``native_api`` the
endpoints · ``metrics`` Prometheus metrics · ``app`` the FastAPI app and ``run_server``.
"""
