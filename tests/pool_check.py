"""The C2 check after a workload: every page and slot taken is back once the prefix cache (images are a
cache, kept by default) is dropped; nothing waits, runs or sits preempted in host memory."""


def assert_pool_full(llm) -> dict[str, int]:
    """`llm`: an LLM or an LLMEngine, idle. Returns its stats."""
    engine = getattr(llm, "engine", llm)
    engine.clear_prefix_cache()
    s = engine.stats()
    assert (s["kv_pages_free"], s["state_slots_free"]) == (s["kv_pages_total"], s["state_slots_total"]), s
    assert s["waiting"] == s["running"] == s.get("preempted_waiting", 0) == 0, s
    return s
