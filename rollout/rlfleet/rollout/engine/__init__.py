"""vLLM driven step by step for many sessions at once, the experts it routed, its metrics."""
