"""UCM for vLLM (coming: the UCMConnector KV connector; nothing is implemented yet)."""
