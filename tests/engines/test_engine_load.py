from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.engines import metric_names, parse_load, parse_samples, slots_usage

VLLM_PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 3.0
vllm:num_requests_waiting{engine="0",model_name="qwen"} 1.0
vllm:gpu_cache_usage_perc{engine="0",model_name="qwen"} 0.25
"""


def test_vllm_older_kv_name_is_the_fallback() -> None:
    load = parse_load(VLLM_PAGE, metric_names("vllm"))
    assert (load.running, load.waiting, load.kv_usage) == (3.0, 1.0, 0.25)


def test_absent_is_unknown_not_zero() -> None:
    load = parse_load("# nothing here\n", metric_names("sglang"))
    assert (load.running, load.waiting, load.kv_usage) == (None, None, None)


def test_llamacpp_has_no_kv_gauge_and_slots_give_it() -> None:
    page = "llamacpp:requests_processing 2\nllamacpp:requests_deferred 0\n"
    load = parse_load(page, metric_names("llama-server"))
    assert (load.running, load.waiting, load.kv_usage) == (2.0, 0.0, None)
    slots = [{"id": i, "is_processing": i < 1} for i in range(4)]
    assert slots_usage(slots) == 0.25
    assert slots_usage([]) is None and slots_usage({"id": 0}) is None


def test_samples_sum_over_label_sets_and_skip_odd_lines() -> None:
    page = 'a{x="1"} 1\na{x="2"} 2.5\nbroken{ 3\nb NaN\nc 7 1700000000\n'
    assert parse_samples(page) == {"a": 3.5, "c": 7.0}


@given(st.text())
def test_any_page_parses_to_numbers(text: str) -> None:
    assert all(isinstance(v, float) for v in parse_samples(text).values())


def test_the_generation_counter_is_read_where_the_engine_has_one() -> None:
    page = VLLM_PAGE + 'vllm:generation_tokens_total{engine="0",model_name="qwen"} 1234.0\n'
    assert parse_load(page, metric_names("vllm")).generated == 1234.0
    assert parse_load(VLLM_PAGE, metric_names("vllm")).generated is None  # absent: unknown
    llama = "llamacpp:requests_processing 1\nllamacpp:tokens_predicted_total 77\n"
    assert parse_load(llama, metric_names("llama-server")).generated == 77.0
    sglang = 'sglang:generation_tokens_total{model_name="m"} 5\n'
    assert parse_load(sglang, metric_names("sglang")).generated == 5.0
