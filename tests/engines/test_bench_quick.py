"""Every benchmark's `--quick` mode runs and prints what its full run prints.

Benchmarks are quoted, not run, between the turns that quote them, so one that breaks
stays broken unseen. Each `bench/*.py` has a quick mode, the same code at the smallest
sizes that still exercise it; this runs it as a user would, from the repository's root,
and checks only that it exits 0 and that its last line of stdout is one JSON object with
the keys its full run prints. Its figures say nothing at these sizes, and timings belong
to the benchmarks (never to a test), so no value is looked at.

`bench/gpu.py` on a machine without CUDA runs every part on the CPU at small shapes (it
forces them; the DeepSpeed step on DeepSpeed's CPU accelerator): the same keys come back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

BENCHMARKS = sorted(path.stem for path in (ROOT / "bench").glob("*.py"))
TIMEOUT_S = 600  # the slowest quick mode (bench/plan.py: four local runs) takes about 5 min
# Quick modes that take from half a minute to five on 2 cores (vLLM, DeepSpeed, whole runs,
# a bed of their own), about 20 minutes together: the suite, which must stay near 30
# minutes, runs the others (about two minutes together), and `make bench-quick` runs all.
LONG = {
    "attacks",
    "faults",
    "gpu",
    "images",
    "operators",
    "pipeline",
    "plan",
    "realtime",
    "rollout_parallel",
    "scaleout",
    "trainer",
    "trainer_ranks",
    "weightsync",
}
ALL_ENV = "RLFLEET_BENCH_QUICK_ALL"  # set (to anything) to run the long ones too

# The top-level keys of each benchmark's JSON object, as its full run prints them. A
# benchmark's keys that depend on its arguments (warmup's `steps_N`) are left out.
KEYS = {
    "acks": "ms_per_step_of_acks",
    "attacks": "attacks_tried attacks_succeeded attacks_skipped by_surface pytest_exit_code",
    "codec_device": """device model_bytes lr changed_fraction pieces compact_gbps encode_gbps
        d2h_bytes full_copy_gbps bit_exact""",
    "envpool": """claim_ms_p50 claim_ms_p99 burst_claim_ms_p99 setup_ms_p50 fork_ms_p50
        fork_over_setup tool_call_ms_p50 sessions_concurrent session_mib
        sessions_fit_in_available_memory escape_attempts escapes escaped
        claim_over_target_p99""",
    "faults": """bench minutes seed faults_injected faults_skipped runs_completed tasks_lost
        trajectories_lost trajectories_trained_twice versions_missing floor_violations
        floor_checks pods_left crashes crashed restarts pod_sync_errors recovery_seconds
        audit""",
    "gpu": """device date quick torch kernels step_s_bf16 tokens_per_s_bf16 slice_parameters
        invariant_share_bf16 max_abs_dlogp_bf16 step_s_fp32 tokens_per_s_fp32
        invariant_share_fp32 max_abs_dlogp_fp32 tokens_per_s_bf16_default
        invariant_share_bf16_default tokens_per_s_fp32_default invariant_share_fp32_default
        invariant_overhead_bf16 train_step_ok train_loss train_weights_device train_numerics
        train_tensors_changed train_delta_bytes train_state_bytes encode_gbps_device
        compact_gbps_device encode_changed_fraction encode_d2h_bytes encode_model_bytes
        bit_exact part_seconds errors""",
    "images": """images operator_start operator_start_in_dev_venv
        ratio_operator_peak_rss_image_to_dev import_all_ok""",
    "operators": """bench apply_to_running_seconds reclaim_seconds reclaim_deadline_seconds runs
        inference_pools reconciles_measured reconcile_p50_seconds reconcile_p99_seconds
        reconcile_p99_seconds_by_kind reconciles_by_kind spec_to_status_p50_seconds
        spec_to_status_p99_seconds status_missing kube_calls kube_call_p50_seconds
        kube_call_p99_seconds kube_calls_per_reconcile""",
    "pipeline": """budget_seconds async_max_staleness updates_per_step sync_steps sync_seconds
        sync_reward_start sync_final_reward sync_idle_fraction sync_staleness_mean
        sync_dropped_stale sync_evaluated_reward async_steps async_seconds async_reward_start
        async_final_reward async_idle_fraction async_staleness_mean async_dropped_stale
        async_evaluated_reward async_seconds_to_sync_reward async_seconds_to_sync_reward_held
        async_time_ratio idle_ratio""",
    "plan": """bench budget_seconds sync async steps_error idle_fraction_error
        staleness_mean_error profile""",
    "realtime": """cycles promoted rejected rolled_back skipped timed_out canary_false_rollbacks
        canary_on_inverted_feedback canary_rollbacks_judged outcomes inverted_cycle_outcome
        accept_rate_by_cycle accept_rate_first accept_rate_last answers_by_cycle
        accept_rate_fitted_rise accept_rate_fitted_rise_per_cycle requests_total
        requests_failed feedback_lost serving_p99_ms_steady serving_p99_ms_during_swap swaps
        swap_requests poisoned_served_fraction canary_fraction cycle_seconds_mean exit_code
        wall_seconds invert_cycle operator""",
    "rollout": """bench sessions turns vllm_tokens_per_s vllm_seconds generated_tokens
        prefix_cache_hit_fraction direct_tokens_per_s harness_tokens_per_s harness_vs_direct
        resegmented_calls episodes_failed hf_tokens_per_s hf_seconds vllm_vs_hf
        sandbox_claim_ms tool_rtt_ms tool_run_rtt_ms""",
    "rollout_parallel": """bench tensor_parallel model_mib worker_extra_mib follower_vs_model
        update_pause_ms cpus""",
    "scaleout": """bench ranks model_mib tensors publish_s_by_ranks publish_snapshot_s_by_ranks
        publish_delta_s_by_ranks step_s_by_ranks step_model publish_extra_mib_by_ranks
        publish_extra_mib_max extra_vs_model cpus""",
    "small_versions": """bench versions workers encode_wall_ms_caller_thread
        encode_cpu_ms_caller_thread apply_wall_ms_caller_thread apply_cpu_ms_caller_thread
        encode_wall_ms_pool encode_cpu_ms_pool apply_wall_ms_pool apply_cpu_ms_pool
        encode_cpu_pool_over_caller_thread apply_cpu_pool_over_caller_thread""",
    "testbed": """bench clusters processes start_seconds idle_rss_mib idle_rss_mib_by_component
        idle_cpu_cores""",
    "trainer": """benchmark model mismatch_kl_replay mismatch_abs_replay mismatch_max_abs_replay
        mismatch_kl_no_replay mismatch_abs_no_replay mismatch_max_abs_no_replay
        routing_agreement replay_kl_reduction step_tokens invariant_step_s default_step_s
        invariant_overhead train_tokens_per_s default_tokens_per_s grpo_shared_step_s
        grpo_whole_step_s prompt_sharing_speedup""",
    "trainer_ranks": """ranks model step_tokens micro_batch_tokens threads_per_rank
        step_s_by_ranks speedup""",
    "warmup": "suite default_steps",
    "weightsync": """bench changed_fraction ratio_vs_full ratio_vs_zstd_full ratio_at_1pct
        size_vs_bound encode_gbps apply_gbps encode_gbps_per_core apply_gbps_per_core
        encode_gbps_at_lr1e-5 apply_gbps_at_lr1e-5 cores memcpy_gbps publish_gbps
        transfer_gbps fetch_gbps fetch_cold_gbps fetch_via_leaf_gbps receive_and_apply_gbps
        transfer_cpu_s_per_gb fetch_cpu_s_per_gb transfer_cpu_bound_gbps fetch_cpu_bound_gbps
        loopback_gbps transfer_vs_loopback fetch_vs_loopback version_latency_s
        version_latency_bound_s version_latency_s_at_lr1e-5 version_latency
        version_latency_scaling join_s join_process_start_s join_fetch_s join_apply_s
        join_model_bytes join_fetched_bytes join_deltas join_verified apply_pause_ms
        first_load_pause_ms inflight_pause_ms drain_wait_ms drain_wait_ms_before
        inflight_versions_exact digest_verified bit_exact chain_length workloads""",
    "weightsync_paths": "bench cores bytes shards variants",
}


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_has_a_quick_mode_and_names_its_keys(name: str) -> None:
    script = Path("bench") / f"{name}.py"
    assert name in KEYS, f"{script}: name the keys it prints in KEYS"
    # Without a quick mode, the full run would start and run past the timeout.
    assert "--quick" in (ROOT / script).read_text(), f"{script} has no --quick"
    assert set(BENCHMARKS) >= LONG, sorted(LONG - set(BENCHMARKS))


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                name in LONG and not os.environ.get(ALL_ENV),
                reason="minutes long: `make bench-quick` runs it",
            ),
        )
        for name in BENCHMARKS
    ],
)
def test_a_benchmarks_quick_mode_prints_its_keys(name: str) -> None:
    script = Path("bench") / f"{name}.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, (  # a benchmark that checks says why in its JSON
        f"{script} --quick exited {done.returncode}:\n"
        f"{done.stderr[-3000:]}\nstdout: {done.stdout[-2000:]}"
    )
    last = (done.stdout.strip().splitlines() or [""])[-1]
    try:
        printed = json.loads(last)
    except json.JSONDecodeError:
        pytest.fail(f"{script} --quick: its last line is not JSON: {last[:500]!r}")
    assert isinstance(printed, dict), f"{script} --quick printed {type(printed).__name__}"
    missing = set(KEYS[name].split()) - set(printed)
    assert not missing, f"{script} --quick printed no {sorted(missing)}: {last[:2000]}"
