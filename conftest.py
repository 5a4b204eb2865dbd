"""Shared pytest hooks for the unit tests and the notebook (nbval) runs.

Markers (registered here, applied here by test file / node id so no test file has to carry them):
- multirank: the test starts rank processes (deepspeed launcher, torchrun, live ranks, a CLI that launches);
- slow: a multirank test, or any test that took more than ~5 s on 2 cores (see SLOW below);
- gpus(n): the test needs n CUDA GPUs (tests/gpu; its conftest skips it otherwise).

`pytest -m "not slow" tests --ignore=tests/browser` (make test-fast) is the quick loop: under 2 minutes on
2 cores. `make test` runs everything.
"""
import os
import sys
from pathlib import Path

import pytest

# The tests and the notebooks' stored outputs are in English, whatever the locale of the machine that runs them
# (dslab.messages speaks Chinese in a zh_* locale); tests of the Chinese messages set the language themselves.
os.environ["DSLAB_LANG"] = "en"
# Every exercise check records its verdict in a progress file (dslab/exercises/progress.py): the tests' and the
# notebooks' checks go to one under build/, never into the home folder of whoever runs the tests.
os.environ.setdefault("DSLAB_PROGRESS", str(Path(__file__).resolve().parent / "build" / "test-progress.jsonl"))

# Tests that start ranks, by node id ("file::test" also covers its parametrized cases; "file::test[case]" one
# case; a file or "folder/" every test in it). Each costs seconds to minutes on 2 cores: process start, `import
# deepspeed`, a process group.
MULTIRANK = (
    "tests/test_accumulation.py::test_accumulation_driver_on_two_ranks",
    # Checkers that launch ranks (dslab.exercises.on_ranks): every exercise's solution, wrong and hard-coded answers
    # run together in one launch per world size (tests/support.py: run_rank_exercises_together), whichever test is
    # first; the others read the results.
    *(f"tests/test_exercises.py::{test}[{exercise_id}]"
      for exercise_id in ("01.average_gradients", "03.engine_loop", "04.offload_loop", "07.init_inference",
                          "10.reduce_to_owners", "11.pipeline", "11.tensor_data", "11.ulysses", "12.uneven_fix",
                          "12.zero3_generate", "13.profiled_flops")
      for test in ("test_solution_is_accepted", "test_wrong_answers_are_refused_naming_their_mistake",
                   "test_a_hard_coded_answer_fails")),
    "tests/test_exercises.py::test_a_learners_exception_on_a_rank_is_shown_as_their_traceback",
    # the same launches, from chapters 10-13's own tests (tests/test_exercises_parallel.py): one per world size each
    "tests/test_exercises_parallel.py::test_solution_passes_and_what_it_measures_holds",
    "tests/test_exercises_parallel.py::test_usual_mistakes_are_named",
    "tests/test_exercises_parallel.py::test_a_hard_coded_answer_fails",
    # the red team's answers of 07, 11 and 12, in the same launches (tests/test_redteam_ranks_a.py)
    "tests/test_redteam_ranks_a.py::test_wrong_answers_are_refused_naming_the_mistake",
    "tests/test_redteam_ranks_a.py::test_right_answers_in_unusual_forms_are_accepted",
    # and those of 03.engine_loop and 13.profiled_flops (tests/test_redteam_ranks_b.py)
    "tests/test_redteam_ranks_b.py::test_engine_loop_accepts_other_right_backwards",
    "tests/test_redteam_ranks_b.py::test_engine_loop_refuses_a_gradient_scaled_or_a_backward_deepspeed_refuses",
    "tests/test_redteam_ranks_b.py::test_profiled_flops_accepts_other_ways_to_read_and_share_the_count",
    "tests/test_redteam_ranks_b.py::test_profiled_flops_refuses_a_right_number_the_asked_profiler_did_not_count",
    # and those of 01, 04, 10, 11.ulysses and 12.uneven_fix (tests/test_redteam_ranks_c.py; 12's scripts launch apart)
    "tests/test_redteam_ranks_c.py::test_wrong_answers_are_refused_naming_the_mistake",
    "tests/test_redteam_ranks_c.py::test_right_answers_in_unusual_forms_are_accepted",
    "tests/test_comm_bytes.py::test_each_rank_sends_what_deepspeeds_algorithm_predicts",  # these two share one
    "tests/test_comm_bytes.py::test_ideal_bytes_of_the_measured_runs_are_the_ring_formulas",  # 3-rank launch
    "tests/test_comm_bytes.py::test_ddp_no_sync_halves_the_bytes_of_two_micro_steps",
    "tests/test_comm_settings.py::test_each_rank_sends_what_the_settings_predict",  # one 3-rank launch
    "tests/test_faults.py::test_rank_killed_by_a_signal_is_named_and_nothing_is_left",
    "tests/test_faults.py::test_ctrl_c_stops_every_rank_and_keeps_the_checkpoint",
    "tests/test_faults.py::test_kill_9_of_the_command_takes_the_launcher_and_ranks_with_it",
    "tests/test_faults.py::test_kill_9_of_the_process_group_of_dslab_sft_leaves_nothing_and_resume_continues_the_loss_curve",
    "tests/test_hang.py::test_cli_hang_timeout_shows_every_rank_and_its_collective_then_stops_the_job",
    "tests/test_hang.py::test_a_rank_computing_silently_for_twice_the_timeout_is_not_stopped",
    "tests/test_hang.py::test_live_ranks_a_slow_task_runs_and_a_hung_one_is_reported_and_stopped",
    "tests/test_launch.py::test_failing_rank_raises_with_its_traceback_and_stops_the_others",
    "tests/test_launch.py::test_the_rank_that_failed_first_is_named_not_the_one_left_waiting",
    "tests/test_launch.py::test_cli_exits_nonzero_fast_on_failure",
    "tests/test_launch.py::test_results_per_rank_and_a_taken_port_is_replaced",
    "tests/test_launch.py::test_run_commands_runs_the_deepspeed_line_as_typed_and_prefixes_each_rank",
    "tests/test_launch.py::test_run_commands_stops_every_node_when_one_fails",
    "tests/test_live.py::test_two_live_ranks_train_zero2_bf16_in_lockstep_then_stop_leaves_nothing",
    "tests/test_live.py::test_ranks_die_with_the_process_that_started_them_even_when_it_is_sigkilled",
    "tests/test_live.py::test_nothing_is_left_after_a_notebook_kernel_ends",
    "tests/test_memory.py::test_measured_totals_match_theory_on_three_ranks",  # these four share one
    "tests/test_memory.py::test_stage2_gradients_are_partitioned_and_boundaries_reported_as_buffers",  # 3-rank
    "tests/test_memory.py::test_stage1_keeps_full_gradients_stage3_partitions_parameters",  # run (a module
    "tests/test_memory.py::test_offload_optimizer_measured_on_the_host",  # fixture): all slow or none
    "tests/test_memory.py::test_try_config_names_the_rank_error_quietly",  # a launched rank
    "tests/test_memory_levers.py::test_measured_optimizer_bytes_match_theory_on_two_ranks",  # these two share
    "tests/test_memory_levers.py::test_bf16_masters_lose_updates_smaller_than_half_a_step",  # the session's live ranks
    "tests/test_sft.py::test_zero3_lora_run_saves_a_real_adapter_that_merges_and_resumes_exactly",
    "tests/test_sft.py::test_training_script_step_is_the_mean_over_every_label_token_of_all_micro_batches_and_ranks",
    "tests/test_sft.py::test_recipe_step_is_the_mean_over_every_label_token_of_all_micro_batches_and_ranks",
    "tests/test_tp_infer.py::test_tp2_equals_hf_and_shards_layers",
    "tests/test_tp_infer.py::test_cli_tp2_equals_tp1",
    "tests/test_tp_infer.py::test_different_prompts_on_ranks_are_refused",
    "tests/test_widgets.py::test_live_explorer_measures_at_once_and_shows_its_config",  # these four share the
    "tests/test_widgets.py::test_stage_and_offload_changes_remeasure_on_the_same_ranks",  # session's live ranks
    "tests/test_widgets.py::test_a_model_too_big_for_the_budget_is_measured_at_the_largest_size_that_fits",
    "tests/test_widgets.py::test_live_world_size_other_than_the_ranks_is_theory_only",
    "tests/browser/test_zero_widget.py",
    "tests/workshop/",  # three learners' chapters at once (make test-workshop)
)

# Single-process tests that took 3 s or more (all cases together) in the measured full run (see
# /work/shared/notes/DONE_tooling.md): subprocesses that import deepspeed, trainings, CLI round trips.
SLOW = (
    "tests/test_accumulation.py::test_activations_grow_with_micro_batch_not_accumulation_steps",
    "tests/test_accumulation.py::test_padding_needs_token_normalisation",
    "tests/test_config.py::test_each_stage_trains_with_deepspeed_initialize",  # both use one module fixture:
    "tests/test_config.py::test_offload_configs_train_with_cpu_adam",  # every stage trained in a subprocess
    "tests/test_config_check.py::test_cli_as_a_module_in_a_fresh_process",
    "tests/test_env.py::test_async_io_is_probed_without_compiler_output",
    "tests/test_env.py::test_cli_env_json_parses_and_text_prints",
    "tests/test_env.py::test_gpu_count_is_0_when_the_gpus_are_hidden_and_imports_no_deepspeed",
    "tests/test_env.py::test_prepare_is_fast_when_cached",
    "tests/test_exercises.py::test_solution_is_accepted[04.zero3_offload]",
    "tests/test_exercises_parallel.py::test_the_next_exercise_gets_torchs_linear_back_after_a_zero3_engine",
    "tests/test_exercises.py::test_solution_is_accepted[13.bf16_states]",  # trains a step on a launched rank
    "tests/test_exercises.py::test_wrong_answers_are_refused_naming_their_mistake[02.amp_clip]",  # fp16 on a CPU
    "tests/test_exercises.py::test_wrong_answers_are_refused_naming_their_mistake[03.token_loss]",
    "tests/test_exercises.py::test_wrong_answers_are_refused_naming_their_mistake[03.fix_loop]",
    "tests/test_exercises.py::test_solution_is_accepted[09.ds_config]",  # TrainingArguments + deepspeed, twice
    "tests/test_exercises.py::test_wrong_answers_are_refused_naming_their_mistake[09.ds_config]",
    "tests/test_exercises.py::test_a_hard_coded_answer_fails[09.ds_config]",
    "tests/test_redteam_inprocess.py::test_wrong_answers_are_refused_naming_the_mistake",  # 16 checks, ~9 s
    "tests/test_hf_bridge.py::test_auto_sources_name_what_the_trainer_fills",  # the same imports
    "tests/test_infer.py::test_cli_json_output",
    "tests/test_infer.py::test_cli_text_file_and_explicit_model_dir",
    "tests/test_lora.py::test_infer_cli_applies_an_adapter_and_refuses_a_bad_one",
    "tests/test_lora.py::test_merge_cli_reports_a_clear_error",
    "tests/test_models.py::test_base_model_answers_simple_questions_in_both_languages",
    "tests/test_models.py::test_build_base_smoke",
    "tests/test_models.py::test_loads_offline_in_a_fresh_process",
    "tests/test_precision.py::test_deepspeed_scaler_replay_and_minimum",
    "tests/test_precision.py::test_deepspeed_fp16_engine_runs_where_the_accelerator_allows_it_and_is_refused_elsewhere",
    "tests/test_zh_edition.py::test_make_test_notebooks_leaves_zh_out",  # collects the notebooks with nbval
    "tests/browser/",
    "tests/jupyterhub/",  # a hub and two learners' servers (make test-jupyterhub)
    "tests/gpu/test_gpu.py::test_every_notebook_runs_on_a_gpu",
)


def _matches(nodeid, prefixes):
    """True if the node id is one of `prefixes`, a parametrized case of one, or in a listed file or folder."""
    for prefix in prefixes:
        if nodeid == prefix or nodeid.startswith(prefix + "[") or nodeid.startswith(prefix + "::") \
                or (prefix.endswith("/") and nodeid.startswith(prefix)):
            return True
    return False


def pytest_configure(config):
    if config.getoption("nbval", default=False) or config.getoption("nbval_lax", default=False):
        # stored notebook outputs: words and integers exactly, kernel-dependent decimals within a tolerance
        sys.path.insert(0, str(Path(__file__).parent / "tests"))
        import nbval_numbers

        nbval_numbers.install()
    config.addinivalue_line("markers", "slow: long on 2 cores; left out by `pytest -m 'not slow'` (make test-fast)")
    config.addinivalue_line("markers", "multirank: starts rank processes (always also slow)")
    config.addinivalue_line("markers", "gpus(n): needs n CUDA GPUs; skipped with the reason elsewhere (tests/gpu)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        nodeid = item.nodeid.replace("\\", "/")
        if _matches(nodeid, MULTIRANK):
            item.add_marker(pytest.mark.multirank)
        if item.get_closest_marker("multirank") or _matches(nodeid, SLOW):
            item.add_marker(pytest.mark.slow)


# --------------------------------------------------------------------------- shared expensive runs

@pytest.fixture(scope="session")
def live_two_ranks():
    """2 live ranks (dslab.live) shared by the tests that only use them: test_widgets.py's explorer and
    test_memory_levers.py's optimizer states. live.start is idempotent in a process, so a test that stops ranks
    itself (test_live.py, which runs before both) must start its own and not take this fixture."""
    from dslab import live

    ranks = live.start(world_size=2)
    yield ranks
    ranks.stop()


def pytest_sessionfinish(session, exitstatus):
    # Multi-rank runs started outside dslab.launch (torchrun, per-node launches) leave DeepSpeed's
    # shared-memory all-reduce buffers behind; free that RAM once the session is over.
    from dslab.launch import remove_stale_shm_buffers

    remove_stale_shm_buffers()


@pytest.fixture
def no_world_size_env(monkeypatch):
    """No WORLD_SIZE from the environment the tests run in (config checks read it as the launch's world size)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
