"""The suite's tiers: what each test needs, assigned here in one place, and the fast tier that leaves the slow ones out.

A test's tiers come from its path (a directory, a module or a `module::test` prefix of its node id, `BY_PATH`) and
from the fixtures it uses, directly or through other fixtures (`BY_FIXTURE`); GPU tests carry `needs_gpu` /
`without_gpu` where they are written, because the skip goes with the mark. The fast tier is every test with none of
`SLOW_TIERS` (`pytest --fast`, or `pytest -m "<FAST>"`). A test that starts worker processes without the `launch`
tier fails at teardown with a message naming this file, so the fast tier cannot quietly grow a launch.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TIERS = {
    "launch": "starts processes that train, simulate a world or benchmark: torchrun, `shardline train/eval/launch`, "
              "a multi-rank oracle, a dry run's fake world, a bench script, a pool of preparation workers",
    "real_checkpoint": "fetches, converts or trains a real pretrained checkpoint",
    "system": "needs a system daemon, root or network namespaces, a container build or a browser",
    "gpu": "needs a CUDA GPU (skipped without one)",
    "no_gpu": "the CPU side of a GPU path (skipped on a GPU machine)",
}
SLOW_TIERS = ("launch", "real_checkpoint", "system")
FAST = " and ".join(f"not {tier}" for tier in SLOW_TIERS)
BUDGET_MINUTES = {"fast": 5, "full": 30}
"""On the AVX512/AMX class, 2 cores: the fast tier for a person's loop, the full suite (what CI runs)."""

LAUNCH = (
    "tests/bench/test_gpu_bench.py::test_cpu_smoke",
    "tests/bench/test_packed_attention_bench.py::test_the_cpu_smoke",
    "tests/bench/test_prepare_bench.py",
    "tests/bench/test_protocols.py::test_protocol_runs_at_small_size",
    "tests/bench/test_protocols.py::test_qlora_runs_beside_its_bf16_base",
    "tests/bench/test_random_init_bench.py",
    "tests/bench/test_startup_bench.py::test_an_import_is_timed_in_a_fresh_interpreter",
    "tests/data/test_bounded_rows.py::test_a_50_mb_row",
    "tests/data/test_bounded_rows.py::test_a_conversation_far_longer",
    "tests/data/test_bounded_rows.py::test_a_json_array_is_read_element_by_element",
    "tests/data/test_bounded_rows.py::test_a_long_text_document",
    "tests/data/test_bounded_rows.py::test_an_example_far_longer",
    "tests/data/test_bounded_rows.py::test_many_large_rows",
    "tests/data/test_formats.py::test_every_format_mixed_trains_on_two_ranks_resumes_exactly_and_exports",
    "tests/data/test_formats.py::test_train_and_launch_refuse_bad_input",
    "tests/data/test_streaming.py::test_a_script_without_a_main_guard",
    "tests/data/test_streaming.py::test_parallel_chunks",
    "tests/faults/",
    "tests/launch/test_elastic.py::test_elastic_job_loses_a_node_and_finishes_on_the_other_from_the_checkpoint",
    "tests/launch/test_elastic.py::test_the_ray_targets_refuse_an_elastic_range_whose_sizes_the_batch_does_not_divide",
    "tests/launch/test_failures.py::test_a_failed_eval_of_a_finished_run_never_changes_the_training_runs_status",
    "tests/launch/test_failures.py::test_bad_input_found_by_the_workers_exits_2_with_one_message",
    "tests/launch/test_failures.py::test_evaluation_failure_after_training_says_training_finished_and_the_checkpoint_is_safe",
    "tests/launch/test_failures.py::test_failure_mid_training_names_the_step_and_the_last_committed_checkpoint",
    "tests/launch/test_k8s_inplace_restart.py::test_a_training_run_that_loses_a_node_restarts_both_pods_in_place_and_finishes",
    "tests/launch/test_k8s_strict.py::test_every_create_of_every_target",
    "tests/launch/test_k8s_wiring.py",
    "tests/launch/test_kubeflow_runtime.py::test_the_sdks_kubernetes_backend_builds_a_valid_trainjob_that_carries_the_spec",
    "tests/launch/test_kubeflow_sdk.py::test_sdk_entry_point_ends_the_process_with_the_workers_exit_code_without_finalising",
    "tests/launch/test_kubeflow_sdk.py::test_sdk_local_process_backend_runs_a_shardline_spec_to_completion_with_live_progress",
    "tests/launch/test_kubeflow_sdk.py::test_sdk_run_lands_on_the_specs_storage_and_a_replaced_pod_resumes_from_its_checkpoint",
    "tests/launch/test_local_runs.py",
    "tests/launch/test_ray.py::test_ray_train_loses_a_worker_then_a_node_resumes_each_time_and_finishes",
    "tests/launch/test_slurm.py::test_sbatch_script_asks_for_the_allocation_and_runs_one_torchrun_per_node",
    "tests/launch/test_torchrun_env.py::test_a_malloc_setting_the_user_made_is_kept",
    "tests/launch/test_torchrun_env.py::test_a_signal_reaching_torchrun_exits_by_what_the_workers_recorded",
    "tests/launch/test_torchrun_env.py::test_a_sigterm_while_torchrun_is_being_started_reaches_it_and_never_orphans_it",
    "tests/launch/test_torchrun_env.py::test_a_torchrun_without_newer_flags_gets_the_command_line_without_them",
    "tests/launch/test_torchrun_env.py::test_cpu_workers_start_with_the_heap_keeping_malloc_settings",
    "tests/launch/test_torchrun_env.py::test_workers_get_this_launchs_prepared_data_and_never_an_inherited_one",
    "tests/launch/test_vertex.py::test_custom_job_has_the_primary_alone_in_pool_0_and_the_other_nodes_in_pool_1",
    "tests/launch/test_vertex_wiring.py",
    "tests/model/test_families.py::test_two_ranks_give_the_same_first_loss_and_step_as_one",
    "tests/model/test_float8.py::test_two_fsdp2_ranks_on_gloo_train_float8_like_bf16",
    "tests/model/test_nf4.py::test_every_rank_computes_with_torchaos_nf4_of_the_whole_weight",
    "tests/model/test_sharded_load.py::test_two_ranks_load_a_checkpoint_reading_only_their_shards",
    "tests/model/test_sharded_load.py::test_two_ranks_random_init_matches_the_plain_build_on_fsdp_and_hsdp_meshes",
    "tests/observe/test_observed_run.py",
    "tests/ops/test_gpucheck.py::test_gpucheck_without_gpu_exits_3_from_the_cli_and_from_the_worker_task",
    "tests/ops/test_netcheck.py::test_one_rank_judges",
    "tests/ops/test_netcheck.py::test_two_process_sweep",
    "tests/tasks/test_tasks.py::test_a_none_task_run_validates",
    "tests/test_environment.py::test_the_worker_refuses_to_start_without_flash_attn_and_records_why",
    "tests/test_plan.py::test_planned_peak_within_20_percent_of_measured",
    "tests/test_plan_qlora.py::test_the_dry_run_simulates",
    "tests/test_python_api.py::test_the_walk_through",
    "tests/test_run_status.py::test_a_run_with_one_live_process_or_processes_elsewhere_stays_running",
    "tests/test_run_status.py::test_a_running_run_whose_processes_are_gone_is_settled_failed_with_its_last_checkpoint",
    "tests/test_run_status.py::test_two_trainings_of_one_run_started_at_once_train_it_once",
    "tests/test_spec.py::test_local_train_refuses_multi_node_spec_before_starting",
    "tests/test_worker.py::test_worker_names_a_bad_spec_field",
    "tests/train/test_checkpoint_store.py::test_every_minutes_makes_all_ranks_agree_to_save",
    "tests/train/test_chunked_loss.py::test_two_fsdp_ranks_take_the_same_first_step_chunked_as_with_the_whole_logits",
    "tests/train/test_context_parallel.py::test_a_ranks_tokens_attend_over_the_whole_row_as_per_document_attention_does",
    "tests/train/test_context_parallel.py::test_fsdp_x_cp_trains_fsdps_losses_and_its_checkpoint_resumes_without_cp",
    "tests/train/test_dpo_end_to_end.py",
    "tests/train/test_dry_run.py::test_absent_lora_targets",
    "tests/train/test_dry_run.py::test_expert_parallel_step_with_balanced_routing",
    "tests/train/test_dry_run.py::test_flops_counted_on_the_simulated",
    "tests/train/test_dry_run.py::test_the_fake_group_returns",  # reads the module's dry-run child (results)
    "tests/train/test_dry_run.py::test_float8_dry_run_converts",
    "tests/train/test_dry_run.py::test_grpo_sampling_simulated",
    "tests/train/test_dry_run.py::test_hsdp_shards",
    "tests/train/test_dry_run.py::test_hub_preset_simulated",
    "tests/train/test_dry_run.py::test_launch_still_refuses",
    "tests/train/test_dry_run.py::test_launch_to_a_cluster_refuses",
    "tests/train/test_dry_run.py::test_lora_on_a_mixture_on_one_gpu_simulated",
    "tests/train/test_dry_run.py::test_lora_presets_flops_differ",
    "tests/train/test_dry_run.py::test_lora_under_tensor_parallel_shards",
    "tests/train/test_dry_run.py::test_mixture_sharded_state_per_rank",
    "tests/train/test_dry_run.py::test_plan_dry_run_prints",
    "tests/train/test_dry_run.py::test_sharded_state_per_rank",
    "tests/train/test_dry_run.py::test_tensor_parallel_shards",
    "tests/train/test_dry_run.py::test_tiny_simulated",
    "tests/train/test_grpo_end_to_end.py",
    "tests/train/test_expert_parallel.py::test_a_transformers_mixture_trains_from_the_cli_at_ep_2",
    "tests/train/test_expert_parallel.py::test_fsdp_2_x_ep_2_and_hsdp_2_x_ep_2_on_four_ranks",
    "tests/train/test_expert_parallel.py::test_two_ranks_ep_1_and_2_equal_transformers_a_broken_dispatch",
    "tests/train/test_hang.py::test_a_rank_stuck_in_its_own_code_is_named_and_without_restarts_the_run_fails_with_exit_76",
    "tests/train/test_hang.py::test_a_sigstopped_rank_is_named_with_its_host_and_the_run_restarts_from_the_checkpoint",
    "tests/train/test_heap.py",
    "tests/train/test_knobs.py::test_worker_refuses_a_spec_for_a_different_world_size",
    "tests/train/test_lora_end_to_end.py",
    "tests/train/test_objective_golden.py::test_two_ranks_equal_the_recorded_golden_runs",
    "tests/train/test_parallel_layouts.py::test_hsdp_2x2_matches_one_process_on_the_same_global_batch",
    "tests/train/test_preemption.py",
    "tests/train/test_qlora_end_to_end.py",
    "tests/train/test_stragglers.py::test_a_rank_slowed_every_step_is_the_slowest_rank_in_the_records_and_the_report",
    "tests/train/test_tensor_parallel.py::test_fsdp_x_tp_trains_resumes_after_kill_9_reshards_and_exports",
    "tests/train/test_tensor_parallel.py::test_lora_resumed_at_another_tp_keeps_tensor_parallel_peers_identical",
    "tests/train/test_tensor_parallel.py::test_lora_under_tp_trains_like_fsdp_and_its_adapter_reloads",
    "tests/train/test_tensor_parallel.py::test_tp_with_selective_checkpointing_and_compile_trains_fsdps_losses_and_generates",
    "tests/train/test_tensor_parallel.py::test_what_tp_leaves_whole_stays_identical_on_tensor_parallel_peers",
    "tests/train/test_training.py",
)
SYSTEM = (
    "tests/launch/test_elastic.py::test_elastic_job_loses_a_node",  # network namespaces (root)
    "tests/launch/test_k8s_inplace_restart.py::test_a_training_run_that_loses_a_node",  # network namespaces
    "tests/launch/test_slurm.py::test_sbatch_script",  # slurmctld, slurmd, munge
    "tests/test_image.py",  # the image's install
    "tests/launch/test_k8s_wiring.py",  # network namespaces
    "tests/launch/test_vertex_wiring.py",  # network namespaces
    "tests/train/test_checkpoint_store.py::test_s3_round_trip",  # a real S3 server (moto)
)
REAL_CHECKPOINT = ("tests/real/",)
BY_PATH: dict[str, tuple[str, ...]] = {}
for _tier, _paths in (("launch", LAUNCH), ("system", SYSTEM), ("real_checkpoint", REAL_CHECKPOINT)):
    for _path in _paths:
        BY_PATH[_path] = (*BY_PATH.get(_path, ()), _tier)
BY_PATH["tests/real/"] += ("launch",)
BY_FIXTURE: dict[str, tuple[str, ...]] = {
    "slurm": ("system", "launch"),
    "ray_head": ("system", "launch"),
    "prometheus": ("system",),
}
"""Fixtures that start a daemon or a run: every test that uses one is in its tiers."""


def needs_gpu(why: str):
    """Marks a test GPU-only and skips it without CUDA (the skip policy lets it skip)."""
    import torch

    return _both(pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=f"needs a CUDA GPU: {why}"))


def without_gpu(why: str, gpu_side: bool | None = None):
    """Marks the CPU-side counterpart of a GPU path, skipped on a GPU machine, or where `gpu_side` says this machine
    is on the GPU side (flash-attn installed); the skip policy lets it skip."""
    import torch

    skip = torch.cuda.is_available() if gpu_side is None else gpu_side
    return _both(pytest.mark.no_gpu, pytest.mark.skipif(skip, reason=f"this machine has a GPU: {why}"))


def _both(*marks):
    def apply(test):
        for mark in marks:
            test = mark(test)
        return test

    return apply


def tiers_of(nodeid: str, fixtures: list[str]) -> set[str]:
    found = {tier for prefix, tiers in BY_PATH.items() if nodeid.startswith(prefix) for tier in tiers}
    return found | {tier for name in fixtures for tier in BY_FIXTURE.get(name, ())}


def tier_of(item: pytest.Item) -> str:
    """`fast` or the first slow tier a test is in: where its time is counted."""
    return next((t for t in SLOW_TIERS if item.get_closest_marker(t)), "fast")


def configure(config: pytest.Config) -> None:
    """Registers the tiers as markers and this module as a plugin; `--fast` narrows `-m` to the fast tier."""
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")
    if config.getoption("fast", False):
        config.option.markexpr = f"({config.option.markexpr}) and {FAST}" if config.option.markexpr else FAST
    config.pluginmanager.register(sys.modules[__name__], "shardline-tiers")
    subprocess.Popen.__init__ = _recording_init


def unconfigure() -> None:
    subprocess.Popen.__init__ = _original_init


TIER_OF: dict[str, str] = {}
"""node id → its tier, for the summary's time by tier."""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for name in sorted(tiers_of(item.nodeid, list(getattr(item, "fixturenames", ())))):
            item.add_marker(name)
        TIER_OF[item.nodeid] = tier_of(item)


# ---- the guard: a worker launch outside the launch tier fails the test ----------------------------------------

_LAUNCHES: dict[str, list[str]] = {}
_running: list[str] = []
_original_init = subprocess.Popen.__init__


def _is_launch(args) -> bool:
    """torchrun, or `python -m` of torch's launcher, the worker or `shardline train/eval/launch`."""
    argv = [os.path.basename(str(a)) for a in ([args] if isinstance(args, str | bytes | os.PathLike) else args)]
    if "torchrun" in argv:
        return True
    modules = [argv[i + 1:i + 3] for i, a in enumerate(argv[:-1]) if a == "-m"]
    return any(m[:1] in (["torch.distributed.run"], ["shardline.worker"]) or
               m in (["shardline.cli", "train"], ["shardline.cli", "eval"], ["shardline.cli", "launch"])
               for m in modules)


def _recording_init(self, args, *rest, **kwargs):
    if _running and _is_launch(args):
        _LAUNCHES.setdefault(_running[-1], []).append(" ".join(map(str, args if not isinstance(args, str)
                                                                      else [args]))[:200])
    _original_init(self, args, *rest, **kwargs)


def launches() -> dict[str, list[str]]:
    """node id → the launches (torchrun, `shardline train/eval/launch`, the worker) its test and fixtures started."""
    return _LAUNCHES


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _running.append(item.nodeid)  # fixtures set up for this test count as its launches
    try:
        return (yield)
    finally:
        _running.pop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = yield
    commands = _LAUNCHES.get(item.nodeid)
    if report.when == "teardown" and commands and tier_of(item) == "fast":
        report.outcome = "failed"
        report.longrepr = (f"started worker processes ({commands[0]}) but is in the fast tier: add it to LAUNCH "
                           f"(or BY_FIXTURE) in tests/tiers.py (the fast tier must not launch)")
    return report
