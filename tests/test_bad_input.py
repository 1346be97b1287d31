"""Bad input raises a clear exception on every rank, never a hang."""
import re

import pytest
import torch

from . import bad_inputs
from .dist_harness import call_many, run_distributed

CASES = [
    (bad_inputs.models_differ, "ValueError",
     [r"model differs from rank 0", r"net\.0\.weight", r"\[37, 13\]", r"\[38, 13\]"]),
    (bad_inputs.buffer_shapes_differ, "ValueError",
     [r"rank 1: model differs from rank 0: buffer '1\.running_mean' \[4\] float32 on rank 0 "
      r"vs '1\.running_mean' \[6\] float32"]),
    (bad_inputs.buffer_dtypes_differ, "ValueError",
     [r"rank 2: model differs from rank 0: buffer 'scale' \[3\] float32 on rank 0 vs "
      r"'scale' \[3\] float64"]),
    (bad_inputs.device_ids_for_a_cpu_module, "ValueError",
     [r"device_ids=\[0\] names cuda:0, but the module's parameters are on \['cpu'\]"]),
    (bad_inputs.sparse_module, "ValueError", [r"sparse gradients are not supported", r"'0'"]),
    (bad_inputs.sparse_gradient_at_runtime, "RuntimeError", [r"'weight' received a sparse gradient"]),
    (bad_inputs.gradient_of_another_shape, "RuntimeError",
     [r"parameter '0\.weight' of shape \(4, 4\) holds a gradient of shape \(3,\)"]),
    (bad_inputs.gradient_of_another_shape_left_by_no_sync, "RuntimeError",
     [r"parameter 'first\.weight' of shape \(4, 4\) holds a gradient of shape \(3,\)"]),
    (bad_inputs.mixed_devices, "ValueError", [r"rank \d: trainable parameters are on several devices"]),
    (bad_inputs.complex_dtype, "ValueError", [r"dtype torch.complex64"]),
    (bad_inputs.non_torch_optimizer, "TypeError", [r"torch.optim.Optimizer subclass"]),
    (bad_inputs.non_elementwise_optimizer, "TypeError", [r"LBFGS is not element-wise"]),
    (bad_inputs.differentiable_optimizer, "ValueError", [r"differentiable=True is not supported"]),
    (bad_inputs.differentiable_group, "ValueError", [r"differentiable=True is not supported"]),
    (bad_inputs.param_groups_replaced_by_others, "ValueError",
     [r"opt\.param_groups can be given new dicts only over the same tensors"]),
    (bad_inputs.param_group_dict_over_other_tensors, "ValueError",
     [r"opt\.param_groups was changed to hold other tensors \(group 0's \"params\" are not "
      r"the tensors it was built with\)", r"would train nothing"]),
    (bad_inputs.param_group_params_replaced, "ValueError",
     [r"opt\.param_groups was changed to hold other tensors \(group 0's"]),
    (bad_inputs.param_groups_dropped, "ValueError",
     [r"groups cannot be added or removed after construction"]),
    (bad_inputs.layerwise_optimizer, "TypeError", [r"FusedLAMB is not element-wise"]),
    (bad_inputs.block_quantized_optimizer, "TypeError",
     [r"AdamW8bit is not element-wise", r"quantized state"]),
    (bad_inputs.block_quantized_by_setting, "TypeError",
     [r"BitsAndBytesLikeAdamW was built with optim_bits=8: its state is quantized in blocks"]),
    (bad_inputs.block_quantized_by_setting_converted, "TypeError",
     [r"fgpsdp: BitsAndBytesLikeAdamW was built with optim_bits=8"]),
    (bad_inputs.per_tensor_clipping_optimizer, "TypeError", [r"GrokAdamW is not element-wise"]),
    (bad_inputs.per_tensor_optimizer_with_its_own_hook_converted, "TypeError",
     [r"fgpsdp: StableAdamW is not element-wise"]),
    (bad_inputs.second_order_optimizer, "TypeError",
     [r"HessianFree is a second-order optimizer", r"carry no graph"]),
    (bad_inputs.second_order_optimizer_by_name, "TypeError",
     [r"Adahessian is a second-order optimizer"]),
    (bad_inputs.foreign_param_in_groups, "ValueError", [r"not a trainable parameter"]),
    (bad_inputs.grad_scaler_step, "RuntimeError",
     [r"GradScaler cannot drive a ShardedOptimizer", r"fgpsdp_runtime\.ShardedGradScaler"]),
    (bad_inputs.grad_scaler_step_through_a_wrapper, "RuntimeError",
     [r"GradScaler cannot drive a ShardedOptimizer", r"fgpsdp_runtime\.ShardedGradScaler"]),
    (bad_inputs.grad_scaler_unscale_then_step, "RuntimeError",
     [r"GradScaler cannot drive a ShardedOptimizer", r"fgpsdp_runtime\.ShardedGradScaler"]),
    (bad_inputs.sharded_grad_scaler_fp16_params, "ValueError",
     [r"Attempting to unscale FP16 gradients"]),
    (bad_inputs.integer_reduce_dtype, "ValueError",
     [r"reduce_dtype must be a floating dtype", r"torch\.int8"]),
    (bad_inputs.init_sync_differs, "ValueError",
     [r"rank 1: init_sync=False, unlike rank 0's True"]),
    (bad_inputs.overlap_plan_set_differently_on_one_rank, "ValueError",
     [r"set_overlap_plan: the ranks' plans differ", r"rank 1: overlap_plan"]),
    (bad_inputs.overlap_plan_of_floats_on_one_rank, "ValueError",
     [r"set_overlap_plan: the ranks' plans differ", r"rank 1: overlap plan problem"]),
    (bad_inputs.overlap_plan_of_floats, "TypeError",
     [r"overlap plan stage2 must hold ints, got 0\.0"]),
    (bad_inputs.optimizer_argument_bad_on_one_rank, "ValueError",
     [r"cannot build the ShardedOptimizer", r"rank 1: .*is not a trainable parameter"]),
    (bad_inputs.optimizer_groups_differ, "ValueError",
     [r"cannot build the ShardedOptimizer", r"rank 1: param_groups"]),
    (bad_inputs.param_group_added_later, "NotImplementedError",
     [r"cannot add a param group after construction"]),
    (bad_inputs.other_models_optimizer_checkpoint, "ValueError",
     [r"param group 0 of the optimizer state dict holds 2 parameters; this optimizer's "
      r"holds 6"]),
    (bad_inputs.optimizer_checkpoint_of_another_shape, "ValueError",
     [r"state 'exp_avg' of saved parameter 4 has shape \(29, 5\); the parameter has \(5, 29\)"]),
    (bad_inputs.not_an_optimizer_checkpoint, "ValueError", [r"not an optimizer checkpoint"]),
    (bad_inputs.two_optimizers, "RuntimeError",
     [r"one ShardedOptimizer per model", r"param_groups"]),
    (bad_inputs.save_between_backward_and_step, "RuntimeError",
     [r"state_dict\(\) or a copy of the module \(copy\.deepcopy, torch\.save\) between "
      r"backward and opt\.step\(\)"]),
    (bad_inputs.optimizer_state_reset_between_backward_and_step, "RuntimeError",
     [r"opt\.state = \.\.\. between backward and opt\.step\(\) would see two_stage's "
      r"speculative updates"]),
    (bad_inputs.optimizer_state_cleared_between_backward_and_step, "RuntimeError",
     [r"opt\.state\.clear\(\) between backward and opt\.step\(\) would see two_stage's "
      r"speculative updates"]),
    (bad_inputs.optimizer_state_dict_between_backward_and_step, "RuntimeError",
     [r"opt\.state_dict\(\) between backward and opt\.step\(\)"]),
    (bad_inputs.cast_after_wrapping, "RuntimeError",
     [r"parameter 'net\.\d\.(weight|bias)' was given new storage", r"torch\.float64"]),
    (bad_inputs.memory_layouts_differ, "ValueError",
     [r"rank 1: model differs from rank 0: parameter '0\.weight' \[4, 3, 3, 3\] float32 "
      r"row-major requires_grad=True on rank 0 vs '0\.weight' \[4, 3, 3, 3\] float32 stored "
      r"in dim order \[0, 2, 3, 1\]", r"convert the memory format on every rank"]),
    (bad_inputs.channels_last_after_wrapping, "RuntimeError",
     [r"parameter '\d\.weight' was given new storage", r"memory format"]),
    (bad_inputs.ddp_mixed_precision, "NotImplementedError",
     [r"mixed_precision=\.\.\.\) .* is not supported", r"reduce_dtype="]),
    (bad_inputs.ddp_delayed_all_reduce, "NotImplementedError",
     [r"delay_all_reduce_named_params / param_to_hook_all_reduce are not supported"]),
    (bad_inputs.process_group_and_device_mesh, "RuntimeError",
     [r"Cannot specify both process_group and device_mesh arguments"]),
    (bad_inputs.all_parameters_frozen, "ValueError",
     [r"rank \d: the module has no parameter that requires a gradient"]),
    (bad_inputs.no_parameters, "ValueError",
     [r"rank \d: the module has no parameter that requires a gradient", r"unfreeze"]),
    (bad_inputs.ignored_parameter_in_groups, "ValueError",
     [r"parameter 'net\.4\.bias' is named in _ddp_params_and_buffers_to_ignore",
      r"optimizer of its own"]),
    (bad_inputs.ignored_trainable_on_one_rank, "ValueError",
     [r"rank 1: trainable parameters in _ddp_params_and_buffers_to_ignore=False, unlike "
      r"rank 0's True"]),
    (bad_inputs.ignored_parameter_converted, "ValueError",
     [r"parameter 'net\.4\.bias' is named in _ddp_params_and_buffers_to_ignore"]),
    (bad_inputs.wrapped_twice, "ValueError",
     [r"parameter 'net\.0\.weight' is held by another fgpsdp DistributedDataParallel",
      r"Wrapping a module again: drop every reference to the old wrapper"]),
    (bad_inputs.shared_by_two_wrappers, "ValueError",
     [r"parameter '0\.weight' is held by another", r"Two models sharing parameters",
      r"wrap one module holding both"]),
    (bad_inputs.unfrozen_after_wrapping, "RuntimeError",
     [r"parameter 'net\.0\.weight' was frozen \(requires_grad=False\) when the module was "
      r"wrapped"]),
    (bad_inputs.nested_join, "RuntimeError", [r"model\.join\(\) contexts cannot be nested"]),
    (bad_inputs.ddp_comm_hook_of_its_own, "NotImplementedError",
     [r"register_comm_hook\(ddp_comm_hook_of_its_own\.<locals>\.averaged\) is not supported",
      r"fp16_compress_hook and bf16_compress_hook", r"reduce_dtype=torch\.float16"]),
    (bad_inputs.model_parallel_group_not_a_group, "TypeError",
     [r"model_parallel_group must be a torch\.distributed ProcessGroup", r"got str"]),
    (bad_inputs.model_parallel_group_built_under_join, "ValueError",
     [r"model_parallel_group is not supported under model\.join\(\)"]),
    (bad_inputs.model_parallel_group_without_this_rank, "ValueError",
     [r"model_parallel_group does not hold this rank"]),
    (bad_inputs.model_parallel_group_on_one_rank, "ValueError",
     [r"cannot build the ShardedOptimizer", r"rank 1: model_parallel_group \(its size\)=1"]),
    (bad_inputs.model_parallel_group_under_join, "NotImplementedError",
     [r"model\.join\(\) with a ShardedOptimizer's model_parallel_group is not supported"]),
    (bad_inputs.pipeline_parallel_group_not_a_group, "TypeError",
     [r"pipeline_parallel_group must be a torch\.distributed ProcessGroup",
      r"other pipeline stages", r"got str"]),
    (bad_inputs.pipeline_parallel_group_without_this_rank, "ValueError",
     [r"pipeline_parallel_group does not hold this rank"]),
    (bad_inputs.pipeline_parallel_group_on_one_rank, "ValueError",
     [r"cannot build the ShardedOptimizer", r"rank 2: pipeline_parallel_group \(its size\)=1"]),
    (bad_inputs.pipeline_parallel_group_under_join, "NotImplementedError",
     [r"model\.join\(\) with a ShardedOptimizer's pipeline_parallel_group is not supported"]),
    (bad_inputs.dtensor_parameter, "ValueError",
     [r"parameter 'net\.2\.weight' is a DTensor \(torch\.distributed\.tensor\): not "
      r"supported", r"device_mesh=mesh\['dp'\]"]),
    (bad_inputs.ignored_parameter_replicas_without_clip, "ValueError",
     [r"ignored_parameter_replicas counts the parameters left to the user in the norm: it "
      r"needs clip_ignored_parameters=True"]),
    (bad_inputs.ignored_parameter_replicas_zero, "ValueError",
     [r"ignored_parameter_replicas must be an int >= 1, got 0"]),
    (bad_inputs.ignored_parameter_replicas_differ, "ValueError",
     [r"cannot build the ShardedOptimizer", r"rank 1: ignored_parameter_replicas=2"]),
    (bad_inputs.ddp_comm_hook_callable_object, "NotImplementedError",
     [r"register_comm_hook\(a _HookObject object\) is not supported"]),
    (bad_inputs.ddp_comm_hook_powersgd, "NotImplementedError",
     [r"register_comm_hook\(powerSGD_hook\) is not supported"]),
    (bad_inputs.ddp_comm_hook_twice, "RuntimeError",
     [r"register_comm_hook can only be called once", r"bf16_compress_hook is registered"]),
    (bad_inputs.ddp_comm_hook_after_backward, "RuntimeError",
     [r"register_comm_hook\(\) after a backward has reduced gradients",
      r"before the first backward"]),
    (bad_inputs.ddp_comm_hooks_differ, "ValueError",
     [r"register_comm_hook: the ranks' hooks differ", r"rank 1.*fp16_compress_hook"]),
    (bad_inputs.ddp_comm_hook_against_reduce_dtype, "ValueError",
     [r"register_comm_hook\(fp16_compress_hook\) would reduce gradients in torch\.float16, "
      r"but the wrapper was built with reduce_dtype=torch\.bfloat16"]),
    (bad_inputs.ddp_comm_hook_state_of_another_group, "ValueError",
     [r"the state names a process group over ranks \[0, 1\], but this wrapper reduces "
      r"over ranks \[0, 1, 2\]"]),
    (bad_inputs.ddp_comm_hook_default_state_on_a_subgroup, "ValueError",
     [r"register_comm_hook\(None, \.\.\.\): torch's hook would reduce over the default "
      r"group, not this wrapper's process_group"]),
    (bad_inputs.optimizer_piece_data_assigned, "RuntimeError",
     [r"a piece of parameter 'net\.\d\.(weight|bias)' in opt\.param_groups was given new storage",
      r"views of this rank's bucket slices"]),
    (bad_inputs.parameter_replaced_after_wrapping, "RuntimeError",
     [r"parameter 'net\.2\.bias' was replaced by another tensor"]),
    (bad_inputs.plain_tensor_written_into_parameters, "RuntimeError",
     [r"parameter 'net\.2\.weight' was replaced by a plain tensor in its module's _parameters",
      r"functional_call puts the parameter back"]),
    (bad_inputs.spectral_norm_after_wrapping, "RuntimeError",
     [r"parameter 'net\.2\.weight' was moved to 'net\.2\.weight_orig' \(as "
      r"torch\.nn\.utils\.spectral_norm does\) after DistributedDataParallel",
      r"Apply such a change to the module before wrapping it"]),
    (bad_inputs.parametrization_after_wrapping, "RuntimeError",
     [r"parameter 'net\.2\.weight' was moved to 'net\.2\.parametrizations\.weight\.original' "
      r"\(as torch\.nn\.utils\.parametrize does\)"]),
    (bad_inputs.old_weight_norm_after_wrapping, "RuntimeError",
     [r"parameter 'net\.2\.weight' was removed from its module after DistributedDataParallel"]),
    (bad_inputs.submodule_replaced_after_wrapping, "RuntimeError",
     [r"submodule 'net\.4' was replaced after DistributedDataParallel",
      r"the parameters of the one it replaced \('net\.4\.(weight|bias)'\)"]),
    (bad_inputs.parameter_added_after_wrapping, "RuntimeError",
     [r"parameter 'temperature' was added after DistributedDataParallel"]),
    (bad_inputs.parameter_views_of_one_tensor, "ValueError",
     [r"parameters 'q' and 'k' are views of one tensor", r"nn\.Parameter\(t\.clone\(\)\)"]),
    (bad_inputs.overlapping_parameters, "ValueError",
     [r"parameters 'q' and 'k' share memory", r"train apart"]),
    (bad_inputs.shared_weight_across_reentrant_checkpoint, "RuntimeError",
     [r"parameter 'shared\.(weight|bias)' received a second gradient", r"use_reentrant=False"]),
    (bad_inputs.two_forwards_through_a_reentrant_checkpoint, "RuntimeError",
     [r"parameter 'inner\.(weight|bias)' received a second gradient",
      r"two forwards before one backward", r"use_reentrant=False"]),
    (bad_inputs.topologies_differ, "ValueError",
     [r"rank 1: one node of 3 ranks, shared memory on, unlike rank 0's no hierarchy, ranks "
      r"on several nodes"]),
    (bad_inputs.topology_invalid_on_one_rank, "ValueError",
     [r"rank 0: world size 3 is not divisible by local_size 2"]),
    (bad_inputs.expanded_parameter, "ValueError",
     [r"parameter 'bias_rows' has elements that share memory \(stride 0"]),
    (bad_inputs.built_under_inference_mode, "ValueError",
     [r"rank 1: the wrapper was built under torch\.inference_mode\(\)"]),
    (bad_inputs.sync_batchnorm_on_cpu, "ValueError",
     [r"SyncBatchNorm layers only work with GPU modules", r"layer '1'"]),
    (bad_inputs.inference_tensor_parameter, "ValueError",
     [r"rank 2: parameter 'net\.0\.weight' is an inference tensor"]),
    (bad_inputs.float8_reduce_dtype, "ValueError",
     [r"reduce_dtype must be a floating dtype", r"float8_e4m3fn"]),
    (bad_inputs.reduce_dtypes_differ, "ValueError",
     [r"rank 1: reduce_dtype=torch\.float16, unlike rank 0's torch\.bfloat16",
      r"rank 2: reduce_dtype=torch\.float16"]),
    (bad_inputs.schedules_and_bucket_caps_differ, "ValueError",
     [r"rank 1: bucket_cap_mb=0\.01, unlike rank 0's None",
      r"rank 2: schedule=serial, unlike rank 0's two_stage \(give every rank the same "
      r"schedule\)"]),
    (bad_inputs.clipping_differs, "ValueError",
     [r"cannot build the ShardedOptimizer", r"rank 1: max_grad_norm=None, unlike rank 0's 1\.0"]),
    (bad_inputs.clipping_of_ignored_parameters_differs, "ValueError",
     [r"rank 1: clip_ignored_parameters=False, unlike rank 0's True"]),
    (bad_inputs.master_weights_differ, "ValueError",
     [r"cannot build the ShardedOptimizer", r"rank 1: master_weights=False, unlike rank 0's "
      r"True"]),
    (bad_inputs.schedule_invalid_on_one_rank, "ValueError",
     [r"rank 1: schedule must be one of .* got 'two-stage'"]),
    (bad_inputs.speculation_memory_invalid, "ValueError",
     [r"rank 1: speculation_memory_mb must be a number >= 0 or None, got -1\.0"]),
    (bad_inputs.speculation_memory_differs, "ValueError",
     [r"rank 2: speculation_memory_mb=32, unlike rank 0's 64"]),
    (bad_inputs.conversion_after_an_lr_scheduler, "ValueError",
     [r"fgpsdp: an lr scheduler \(StepLR\) was built on this optimizer",
      r"Build the scheduler on the optimizer from_optimizer returns"]),
    (bad_inputs.conversion_after_an_lr_scheduler_on_one_rank, "ValueError",
     [r"cannot convert the optimizer", r"rank 2: optimizer to convert=ValueError: an lr "
      r"scheduler \(StepLR\) was built on this optimizer.*, unlike rank 0's convertible"]),
    (bad_inputs.conversion_with_a_step_hook, "ValueError",
     [r"hooks registered on it \(step_post_hooks\): register them on the optimizer "
      r"from_optimizer returns"]),
    (bad_inputs.conversion_stepped_on_one_rank, "ValueError",
     [r"rank 1: its state=stepped, unlike rank 0's none"]),
    (bad_inputs.conversion_reading_raises_on_one_rank, "ValueError",
     [r"rank 1: optimizer to convert=convertible, unlike rank 0's RuntimeError: reading the "
      r"optimizer raised RuntimeError: not available on this rank"]),
    (bad_inputs.conversion_of_a_framework_wrapper, "TypeError",
     [r"_FrameworkOptimizer wraps another optimizer \(AdamW\): convert that one"]),
]
if hasattr(torch.optim, "Muon"):  # torch >= 2.9
    CASES.append((bad_inputs.muon_optimizer, "TypeError",
                  [r"Muon is not element-wise", r"use fgpsdp_runtime\.MuonWithAdamW"]))


@pytest.fixture(scope="module")
def outcomes():
    """Every case in one set of processes: [{(fn,): outcome} per rank]."""
    calls = [(fn,) for fn, _, _ in CASES]
    return run_distributed(3, call_many, calls, True, timeout_s=300, pg_timeout_s=30)


@pytest.mark.parametrize("fn, error_type, patterns", CASES, ids=[c[0].__name__ for c in CASES])
def test_every_rank_raises(outcomes, fn, error_type, patterns):
    for rank, per_case in enumerate(outcomes):
        res = per_case[(fn,)]
        assert not res["ok"], f"rank {rank} accepted bad input"
        assert res["type"] == error_type, f"rank {rank}: {res['type']}: {res['message']}"
        for pattern in patterns:
            assert re.search(pattern, res["message"]), (rank, pattern, res["message"])


def test_equal_settings_in_other_types_are_accepted():
    buckets = run_distributed(3, bad_inputs.settings_equal_in_other_types, timeout_s=120)
    assert buckets[0] == buckets[1] == buckets[2] > 0


def test_buffers_that_are_never_broadcast_may_differ():
    assert run_distributed(3, bad_inputs.rank_local_buffers_unsynced, timeout_s=120) == [1, 1, 1]


def test_an_optimizer_on_the_unwrapped_module_says_to_wrap_first():
    import fgpsdp_runtime as fgp
    with pytest.raises(TypeError, match=r"got Linear: wrap the module first, then build the "
                                        r"optimizer on the wrapper"):
        fgp.ShardedOptimizer(torch.nn.Linear(2, 2), torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("settings", [{"schedule": "serial"}, {"overlap_plan": "layout"}])
def test_a_speculation_budget_the_plan_ignores_is_warned_at_the_callers_line(settings):
    """Said before any group is needed (here, none is), and pointing at the line that
    built the wrapper, not at the library's."""
    import fgpsdp_runtime as fgp
    with pytest.warns(UserWarning, match=r"speculation_memory_mb bounds the plan two_stage "
                                         r"derives with overlap_plan='auto' only") as caught, \
            pytest.raises(RuntimeError, match=r"init_process_group\(\) first"):
        fgp.DistributedDataParallel(torch.nn.Linear(2, 2), speculation_memory_mb=64, **settings)
    assert [w.filename for w in caught if "speculation_memory_mb" in str(w.message)] == [__file__]


def test_a_sparse_module_the_wrapper_leaves_alone_is_no_problem():
    """A sparse embedding named in _ddp_params_and_buffers_to_ignore (a rank-local
    expert table, stepped by the user's SparseAdam) has no bucket to break."""
    from fgpsdp_runtime.validation import local_problems
    module = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    named = list(module.named_parameters())
    assert local_problems(module, [(n, p) for n, p in named if not n.startswith("0.")]) == []
    assert any("sparse gradients are not supported" in problem
               for problem in local_problems(module, named))
