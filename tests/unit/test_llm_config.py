"""The vllm runtime's configuration: engine flags, the passthrough's rules, the token budget, metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from loom.workloads.llm.budget import RequestBudget, TokenBudget
from loom.workloads.llm.config import EngineOptions, LlmServerConfig, engine_flags
from loom.workloads.llm.engine import engine_argv, engine_environment
from loom.workloads.llm.metrics import LlmMetrics, engine_families


def test_defaults_leave_vllm_its_own_defaults() -> None:
    assert engine_flags(EngineOptions()) == ["--dtype=auto", "--tensor-parallel-size=1"]


def test_every_typed_field_becomes_its_flag() -> None:
    options = EngineOptions.model_validate({
        "maxModelLen": 256, "gpuMemoryUtilization": 0.8, "kvCacheMemoryBytes": 1 << 28, "dtype": "bfloat16",
        "tensorParallelSize": 2, "enablePrefixCaching": False, "maxNumSeqs": 64, "chatTemplate": "{{ x }}",
        "enforceEager": True, "extraArgs": ["--seed=3", "--disable-log-stats"],
    })
    flags = engine_flags(options, Path("/tmp/t.jinja"))
    assert flags == [
        "--max-model-len=256", "--gpu-memory-utilization=0.8", f"--kv-cache-memory-bytes={1 << 28}",
        "--max-num-seqs=64", "--dtype=bfloat16", "--tensor-parallel-size=2", "--no-enable-prefix-caching",
        "--enforce-eager", "--chat-template=/tmp/t.jinja", "--seed=3", "--disable-log-stats",
    ]
    assert "--enable-prefix-caching" in engine_flags(EngineOptions(enable_prefix_caching=True))


@pytest.mark.parametrize("arg", ["--port=9", "--model", "--served-model-name=x", "--api-key=s", "-x", "seed=3"])
def test_the_passthrough_refuses_the_fronts_flags_and_non_flags(arg: str) -> None:
    with pytest.raises(ValidationError):
        EngineOptions(extra_args=[arg])


def test_the_engine_listens_on_the_loopback_only_under_the_served_name() -> None:
    config = LlmServerConfig(model_name="tiny", model_dir="/models/m", engine_python="/env/bin/python",
                             engine_port=9001)
    argv = engine_argv(config)
    assert argv[:3] == ["/env/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert {"--model=/models/m", "--served-model-name=tiny", "--host=127.0.0.1", "--port=9001"} <= set(argv)


def test_a_one_device_engine_keeps_its_worker_in_the_engine_process_unless_told_otherwise() -> None:
    one = LlmServerConfig(model_name="tiny", model_dir="/m", engine_python="/py")
    assert "--distributed-executor-backend=uni" in engine_argv(one)
    assert engine_environment(one, {})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert engine_environment(one, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    split = LlmServerConfig(model_name="tiny", model_dir="/m", engine_python="/py",
                            engine=EngineOptions(tensor_parallel_size=2))
    assert not any(a.startswith("--distributed-executor-backend") for a in engine_argv(split))
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in engine_environment(split, {})
    told = LlmServerConfig(model_name="tiny", model_dir="/m", engine_python="/py",
                           engine=EngineOptions(extra_args=["--distributed-executor-backend=mp"]))
    assert [a for a in engine_argv(told) if a.startswith("--distributed")] == ["--distributed-executor-backend=mp"]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in engine_environment(told, {})


def test_the_config_round_trips_through_camel_case_json() -> None:
    config = LlmServerConfig.model_validate({
        "modelName": "tiny", "modelDir": "/m", "engine": {"maxModelLen": 128},
        "limits": {"tokensPerMinute": 100, "requestsPerMinute": 10},
    })
    again = LlmServerConfig.model_validate_json(config.to_json())
    assert again == config and '"maxModelLen":128' in config.to_json()
    with pytest.raises(ValidationError):
        LlmServerConfig(model_name="bad name", model_dir="/m")


def test_the_token_budget_refuses_a_spent_key_until_the_window_slides() -> None:
    budget = TokenBudget(100, window_s=60)
    assert budget.check("a", 0.0) is None
    budget.charge("a", 70, 0.0)
    assert budget.check("a", 1.0) is None  # 70 < 100: may start
    budget.charge("a", 50, 10.0)  # a request may go past the budget: its cost is known only at its end
    assert budget.check("a", 11.0) == pytest.approx(49.0)  # under 100 again when the 70 slide out at 60 s
    assert budget.check("b", 11.0) is None  # budgets are per key
    assert budget.check("a", 60.0) is None


def test_the_token_budget_keeps_its_sum_as_charges_slide_out() -> None:
    budget = TokenBudget(61, window_s=60)
    for second in range(120):  # one token a second for two minutes: the first minute's charges slide out
        budget.charge("a", 1, float(second))
    assert budget.check("a", 119.5) is None  # the 60 charges of (59.5, 119.5]
    budget.charge("a", 1, 119.5)
    assert budget.check("a", 119.5) == pytest.approx(0.5)  # 61: under again when the charge of 60 s slides out
    assert budget.check("a", 120.0) is None


def test_the_request_budget_counts_each_request_as_it_starts_and_not_the_refused_ones() -> None:
    budget = RequestBudget(2, window_s=60)
    assert budget.hit("a", 0.0) is None
    assert budget.hit("a", 10.0) is None
    assert budget.hit("a", 20.0) == pytest.approx(40.0)  # the third in a minute: when the first slides out
    assert budget.hit("b", 20.0) is None  # per key
    assert budget.hit("a", 60.0) is None  # the first slid out; the refused one never counted
    assert budget.hit("a", 61.0) == pytest.approx(9.0)


def test_metrics_keep_the_engines_vllm_families_only() -> None:
    text = "\n".join([
        "# HELP python_gc_objects_collected_total x", "# TYPE python_gc_objects_collected_total counter",
        "python_gc_objects_collected_total 3",
        "# HELP vllm:num_requests_running Running.", "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="tiny"} 2.0',
    ])
    assert engine_families(text).splitlines() == [
        "# HELP vllm:num_requests_running Running.", "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="tiny"} 2.0',
    ]
    metrics = LlmMetrics("tiny")
    metrics.finished(started=0.0, first_token=0.5, ended=1.5, prompt=4, completion=11)
    out = metrics.exposition(text).decode()
    assert 'loom_llm_time_to_first_token_seconds_sum{model="tiny"} 0.5' in out
    assert 'loom_llm_time_per_output_token_seconds_sum{model="tiny"} 0.1' in out
    assert 'loom_llm_generation_tokens_total{model="tiny"} 11.0' in out
    assert 'vllm:num_requests_running{model_name="tiny"} 2.0' in out and "python_gc" not in out
