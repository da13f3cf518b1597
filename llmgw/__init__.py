"""llmgw: run a fleet of LLM-serving machines behind one OpenAI endpoint."""

__version__ = "0.1.0"
