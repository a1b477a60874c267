"""kvstreamd inside a serving engine: the parts of a KV connector that do not depend on the
engine (paged.py: where a paged cache keeps each token's K and V, learned by a probe; plan.py:
which tokens a request loads and saves; options.py: the connector's settings), and the vLLM
connector itself (vllm_connector.py, the one module of kvstreamd that imports vLLM)."""
