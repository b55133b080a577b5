"""Which dimensions beyond dp x tp x pp each training framework runs: cp, HSDP, offload, dtypes.

One entry per framework of ``frameworks.FRAMEWORKS``, merged into its ``Framework`` record
(fields ``context_parallel``, ``hsdp``, ``offloads``, ``dtypes``, and how it runs them:
``cp_comm`` "ring" (point-to-point K/V, overlapped with attention), "all_gather" (one K/V
all-gather per attention, exposed) or "all_gather_rotate" (torch's gather under the rank's own
block: cp_comm.py); ``ep_with_cp``; ``moe_zero_stages``, the ZeRO stages it trains a
mixture-of-experts model with; ``expert_gemm_calls``, the GEMM
calls per local expert of a framework that loops over its experts (0: one grouped GEMM for all:
moe.py); ``expert_tensor_parallel``, routed experts sharded over tp (else every tp rank holds and
runs them whole: expert_tp.py ``replicated_experts``); ``expert_tp_folded``, routed experts
whole on each rank with each tp rank routing its own tokens over an ep group of consecutive
ranks (Megatron-Core's expert tensor parallel size 1: expert_tp.py ``folded_experts``), and
``fold_needs_ep``, only with ep > 1 (else the experts stay split over tp);
``moe_sequence_parallel``, mixture-of-experts blocks run under sequence parallelism (with
experts whole on every tp rank, by gathering the whole sequence into the MoE module);
``moe_tp``, how MoE blocks talk over tp
(collectives.MOE_TPS, framework_support ``moe_tp_mode``): "gather" (that whole sequence),
"boundary" (with ep off the routed experts split over tp and the MoE output, shared experts'
included, reduced once at the module's boundary: an MLP's calls), "rows" (the dispatched rows
all-gathered over tp before the experts and reduce-scattered after them), "linears" (only the
linears the profile lists);
``offload_optimizer_moves_params``, an optimizer offload that also keeps parameters and
gradients on the host, costed as ``offload="params"`` (offload.py); ``attention_kernel``,
the kernel of a fused attention core: "fused" (cuDNN / FlashAttention-3, the matmul curve's
rate) or "flash2" (FlashAttention-2, the device's ``flash2_attention_ratio`` of it:
compute.attention_ratio); ``fused_swiglu``, a SwiGLU kernel
that recomputes the activated gate instead of keeping it; ``native_gqa``, grouped-query
attention whose kernel reads the kv heads in place instead of repeated copies;
``fp8_saves_inputs``, fp8 linears that keep their fp8 input for the weight gradient;
``fused_norms``, norm kernels that keep their input and statistics only, not a composite norm's
fp32 copies; ``scatter_combine``, a mixture-of-experts combine that scatters the expert outputs
back (keeping the indices only), not index_add's copy of them (graph/recorder.py);
``moe_force_balance``, a router forced to spread tokens evenly (a benchmark mode) and
``ep_dispatch``, "all_to_all" or DeepEP's "hierarchical" dispatch (moe.py), both off unless a
setting turns them on); ``runs_traced_modules``, the framework runs the profiled modules
themselves (autopar's runtime), so it shards only what they let it: cp on the zoo's attention
and on Hugging Face decoders calling transformers' attention interface with rotary positions
(``ModelProfile.cp_blocker``), ep on experts it runs one at a time (``MoEStructure.ep_blocker``),
tp where no weight across heads sits beside the split linears (``TPStructure.split_blocker``);
``recompute_layers``, the per-layer recompute it sets (recompute_layers.py: any mix, the first n
blocks of each stage, every n-th block of a rank, or one mode for all); ``stage_splits``, the
pipeline stage splits it cuts (stage_splits.py: any, or DeepSpeed's partition methods'); a
framework that trains its own
implementation of the architecture splits it whatever code was profiled), each with its source;
``static_grad_buffer``, one contiguous gradient buffer of ``grad_reduce_bytes`` per parameter
the rank holds, allocated with the model and kept for the run on every data rank whatever the
ZeRO stage and the number of micro-batches, the weight-gradient GEMMs accumulating into it
(Megatron-Core's, memory.py), instead of gradients born in the backward;
``fsdp_root_holds_edges``, ZeRO-3 at one stage wraps each block and then the whole model, whose
root unit holds the other layers (the embedding and the head): their gathered parameters and
the head's gradient stay over the step (dp_comm.fsdp_root_bytes);
``supports_dimensions`` says why a framework cannot run a config's cp, HSDP, offload or dtype.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DIMENSIONS", "DIMENSION_SOURCES", "supports_dimensions"]

# measured: torch 2.13's SDPA tries its flash backend (FlashAttention-2's kernels) first
# (torch._C._get_sdp_priority_order() == [FLASH, EFFICIENT, MATH, CUDNN, OVERRIDEABLE]) and
# leaves FlashAttention-3 off (torch._C._get_fa3_sdp_enabled() is False).
_TORCH_SDPA = ("measured: F.scaled_dot_product_attention runs torch's flash backend "
               "(FlashAttention-2) first; FlashAttention-3 is opt-in (torch 2.13)")

DIMENSIONS: dict[str, dict[str, Any]] = {
    "autopar": dict(
        context_parallel=True, hsdp=True, offloads=("none", "optimizer", "params"),
        dtypes=("bf16", "fp16", "fp32"), cp_comm="all_gather", ep_with_cp=True,
        offload_optimizer_moves_params=True, expert_gemm_calls=2,
        expert_tensor_parallel=False, expert_tp_folded=False, moe_sequence_parallel=True,
        moe_tp="gather",
        attention_kernel="flash2",
        fused_swiglu=False, native_gqa=False, moe_force_balance=False, ep_dispatch="all_to_all",
        fp8_saves_inputs=False, fused_norms=False, scatter_combine=False, runs_traced_modules=True,
        recompute_layers="any", stage_splits="any", static_grad_buffer=False,
        fsdp_root_holds_edges=True,
    ),
    "torchtitan": dict(
        context_parallel=True, hsdp=True, offloads=("none", "params"),
        dtypes=("bf16", "fp32", "fp8"), attention_kernel="flash2",
        cp_comm="all_gather_rotate", fused_swiglu=False, native_gqa=True, moe_tp="boundary",
        expert_tp_folded=False, fold_needs_ep=True,
        moe_force_balance=False, ep_dispatch="all_to_all", fp8_saves_inputs=False,
        fused_norms=True, scatter_combine=False, recompute_layers="every-nth",
        stage_splits="any", static_grad_buffer=False,
    ),
    "megatron-lm": dict(
        context_parallel=True, hsdp=True, offloads=("none", "optimizer"),
        dtypes=("bf16", "fp16", "fp32", "fp8"), attention_kernel="fused", fused_swiglu=True,
        moe_tp="rows", expert_tp_folded=False,
        native_gqa=True, moe_force_balance=False, ep_dispatch="all_to_all",
        fp8_saves_inputs=True, fused_norms=True, scatter_combine=True, recompute_layers="first-n",
        stage_splits="any", static_grad_buffer=True,
    ),
    "deepspeed": dict(
        context_parallel=False, hsdp=False, offloads=("none", "optimizer", "params"),
        dtypes=("bf16", "fp16", "fp32"), expert_gemm_calls=3, expert_tensor_parallel=False,
        moe_zero_stages=(0, 1, 2),
        expert_tp_folded=False,
        attention_kernel="flash2", fused_swiglu=False, native_gqa=False,
        moe_force_balance=False, ep_dispatch="all_to_all", fp8_saves_inputs=False,
        fused_norms=True, scatter_combine=False, recompute_layers="uniform",
        stage_splits="partition-methods", static_grad_buffer=False,
    ),
}

# A framework that trains its own implementation of an architecture splits it over tp, cp and
# ep whatever code (a Hugging Face model, a model file) autopar profiled.
_OWN_MODEL_CODE = ("sourced: the framework runs its own model code (torchtitan's models/, "
                   "Megatron-Core's GPTModel, Megatron-DeepSpeed's GPTModel), not the traced "
                   "modules: its tp, cp and ep do not depend on them")

DIMENSION_SOURCES: dict[str, dict[str, str]] = {
    "autopar": {
        "static_grad_buffer": "sourced: autopar/runtime/data_parallel.py (FSDP2 and DDP: "
                              "gradients allocated in the backward, freed by zero_grad)",
        "fsdp_root_holds_edges": "sourced: autopar/runtime/data_parallel.py fully_shard of "
                                 "each block, then of the stage module (its root unit)",
        "stage_splits": "sourced: autopar/runtime/pipeline_parallel.py builds each stage "
                        "from the plan's own layer bounds (_owned_blocks)",
        "recompute_layers": "sourced: autopar/runtime/recompute.py apply_recompute wraps each "
                            "block in its own plan mode (none, selective or full)",
        "context_parallel": "sourced: autopar/runtime/context_parallel.py (the zoo's "
                            "attention, or a Hugging Face decoder's through transformers' "
                            "attention interface, all-gathers K/V over cp, load-balanced "
                            "sequence shards; graph.cp.cp_blocker; ep=1)",
        "hsdp": "sourced: autopar/runtime/mesh.py data_parallel_mesh: FSDP2 over a 2-D "
                "(replicate, shard) mesh",
        "offloads": "sourced: autopar/runtime/data_parallel.py: FSDP2 CPUOffloadPolicy for "
                    "both (optimizer offload also keeps parameters and gradients on the host)",
        "dtypes": "sourced: autopar/runtime/step.py autocast / MixedPrecisionPolicy in "
                  "bf16, fp16 or fp32; no fp8 linears",
        "cp_comm": "sourced: autopar/runtime/context_parallel.py ContextParallel.gather and "
                   "models/attention.py: one all_gather_into_tensor of K and V stacked per "
                   "attention, waited on at once (not overlapped), its autograd rule one "
                   "reduce_scatter_tensor; counted by tests/distributed/"
                   "test_runtime_dims_collectives.py",
        "ep_with_cp": "sourced: autopar/runtime/expert_parallel.py ep_groups cuts the ep "
                      "groups from the dp x cp ranks (tests/distributed/test_runtime_moe.py "
                      "dp2 x cp2 ep2)",
        "moe_zero_stages": "sourced: autopar/runtime/expert_parallel.py: FSDP2 shards the "
                           "experts over their own data-parallel ranks at every ZeRO stage",
        "offload_optimizer_moves_params": "sourced: autopar/runtime/data_parallel.py "
                                          "_offload_policy: FSDP2 CPUOffloadPolicy for "
                                          "offload='optimizer' too, which (its torch 2.13 "
                                          "docstring) offloads parameters, gradients and "
                                          "optimizer states, copies the sharded parameters "
                                          "up before each all-gather and the gradients down",
        "expert_gemm_calls": "sourced: autopar/models/moe.py Experts.forward and "
                             "runtime/expert_parallel.py loop over the local experts, two "
                             "F.linear each (gate_up_proj, down_proj)",
        "expert_tensor_parallel": "sourced: autopar/runtime/tensor_parallel.py shards "
                                  "linears only: the zoo's Experts tensors stay whole on "
                                  "every tp rank, which runs every token's experts "
                                  "(tests/distributed/test_runtime_moe.py tp case)",
        "expert_tp_folded": "sourced: autopar's runtime keeps routed experts whole on every "
                            "tp rank and runs every token's (expert_tensor_parallel above), "
                            "not folded",
        "fold_needs_ep": "sourced: no folding (expert_tp_folded)",
        "moe_sequence_parallel": "sourced: autopar/runtime/tensor_parallel.py gathers the "
                                 "whole sequence into a MoE module (GatherSequence: "
                                 "all-gather in, its replicated output cut back to the "
                                 "sequence shard; tests/distributed/test_runtime_moe.py sp "
                                 "cases)",
        "moe_tp": "sourced: autopar/runtime/tp_styles.py GatherSequence (under SP) and "
                  "tensor_parallel.py: routed experts whole, shared experts' linears split "
                  "(tests/distributed/test_runtime_moe.py counts)",
        "attention_kernel": _TORCH_SDPA,
        "fused_swiglu": "sourced: autopar/models/llama.py SwiGLU runs w2(silu(w1(x)) * w3(x)) "
                        "eagerly: silu's output is kept for the product's backward",
        "native_gqa": "sourced: autopar/models/attention.py repeats K/V with "
                      "torch.repeat_interleave before scaled_dot_product_attention, which "
                      "keeps the repeated copies for its backward",
        "moe_force_balance": "sourced: autopar/models/moe.py routes each token to its "
                             "router's top-k experts; nothing forces the balance",
        "ep_dispatch": "sourced: autopar/runtime/expert_parallel.py: all_to_all_single of "
                       "every routed row",
        "fp8_saves_inputs": "sourced: autopar's runtime has no fp8 linears (dtypes above)",
        "fused_norms": "sourced: autopar's runtime runs the model's own norm modules (a "
                       "Hugging Face *RMSNorm as its elementwise ops; the zoo's F.rms_norm / "
                       "F.layer_norm as one kernel)",
        "scatter_combine": "sourced: autopar's runtime runs the model's own experts (Hugging "
                           "Face's and graph/moe.py's combine with index_add, which keeps its "
                           "source)",
        "runs_traced_modules": "sourced: autopar/runtime/apply.py runs the model's own modules: "
                               "it refuses cp > 1 unless the zoo's attention runs it "
                               "(graph.cp.cp_blocker), ep > 1 unless "
                               "graph.moe.ep_blocker finds the experts runnable one at a time "
                               "(_check_ep), and tp > 1 "
                               "where graph.tp.split_blocker names a weight across heads "
                               "(tp_checks.py)",
    },
    "torchtitan": {
        "static_grad_buffer": "sourced: torchtitan's FSDP2 / DDP (gradients allocated in the "
                              "backward, FSDP2's sharded by reduce-scatter)",
        "fsdp_root_holds_edges": "sourced: torchtitan models/llama3 parallelize.py apply_fsdp "
                                 "wraps tok_embeddings and [norm, output] as their own units "
                                 "before the root",
        "stage_splits": "sourced: torchtitan v0.2.2 parallelism.module_fqns_per_model_part "
                        "names every stage's modules (distributed/pipeline_parallel.py)",
        "recompute_layers": "sourced: torchtitan v0.2.2 activation_checkpoint mode 'selective' "
                            "with selective_ac_option 'N': full recompute of every N-th block "
                            "a rank builds (_apply_layer_sac, one count per process), or one "
                            "mode for all",
        "context_parallel": "sourced: torchtitan v0.2.2 parallelism.context_parallel_degree "
                            "(torch context_parallel, ring attention; FSDP over dp_shard_cp)",
        "hsdp": "sourced: torchtitan v0.2.2 parallelism.data_parallel_replicate_degree with "
                "data_parallel_shard_degree > 1 is HSDP (config/job_config.py)",
        "offloads": "sourced: torchtitan v0.2.2 training.enable_cpu_offload (FSDP2 "
                    "CPUOffloadPolicy: parameters, gradients and optimizer state)",
        "dtypes": "sourced: torchtitan v0.2.2 training.mixed_precision_param bfloat16 / "
                  "float32 (config/job_config.py: no float16) and the quantize.linear.float8 "
                  "converter (torchao); a part without bf16 tensor cores (V100) runs bf16 at "
                  "its slow rate there",
        "cp_comm": "sourced: torchtitan v0.2.2 job_config.py context_parallel_rotate_method "
                   "= 'allgather' (the default) for torch's context_parallel: "
                   "_AllGatherRotater gathers K/V once under the rank's own block, dK/dV "
                   "pass the ring in fp32 (_templated_ring_attention_backward); setting "
                   "'cp-rotate-alltoall': the ring",
        "ep_with_cp": "sourced: torchtitan v0.2.2 ParallelDims: ep borrows its ranks from "
                      "dp_shard * cp",
        "moe_zero_stages": "sourced: torchtitan v0.2.2 parallelize: FSDP2 shards the experts "
                           "over dp_shard (its MoE models train with ZeRO-3)",
        "offload_optimizer_moves_params": "sourced: torchtitan has no optimizer-only "
                                          "offload (offloads above)",
        "expert_gemm_calls": "sourced: torchtitan's GroupedExperts (use_grouped_mm: "
                             "torch._grouped_mm over all local experts): 0",
        "expert_tensor_parallel": "sourced: torchtitan models/common/MOE_SHARDING.md: with "
                                  "ep off the routed experts are TP-sharded (colwise / "
                                  "rowwise), with ep on sharded over ep",
        "expert_tp_folded": "sourced: off unless the 'expert-tp-1' setting is on (autopar's "
                            "torchtitan export writes expert_tensor_parallel_degree = tp)",
        "fold_needs_ep": "sourced: torchtitan v0.2.2 job_config.py "
                         "expert_tensor_parallel_degree 'No effect ... when ep = 1'",
        "moe_sequence_parallel": "sourced: torchtitan models/common/MOE_SHARDING.md (SP on: "
                                 "the MoE input Shard(1) -> Replicate, output -> Shard(1))",
        "moe_tp": "sourced: torchtitan models/common/MOE_SHARDING.md: with ep off the MoE "
                  "input is Shard(1) -> Replicate (SP) or replicated, routed experts "
                  "TP-sharded, the shared experts' w2 output stays Partial and the sum is "
                  "reduced once at the MoE boundary (-> Shard(1) or Replicate); with ep on "
                  "each tp rank routes its own tokens",
        "attention_kernel": _TORCH_SDPA,
        "fused_swiglu": "sourced: torchtitan's FeedForward runs w2(F.silu(w1(x)) * w3(x)) "
                        "eagerly (torch.compile may fuse it; not costed)",
        "native_gqa": "sourced: torchtitan v0.2.2 models/llama3/model/model.py passes "
                      "enable_gqa=n_heads > n_kv_heads to scaled_dot_product_attention "
                      "(v0.2.0 repeated K/V with repeat_kv); torch's docs: GQA runs in the "
                      "flash backend on CUDA, which reads the kv heads in place",
        "moe_force_balance": "sourced: off unless the 'moe-force-balance' setting is on "
                             "(debug.moe_force_load_balance, default False)",
        "ep_dispatch": "sourced: torch all-to-all unless the 'ep-deepep' setting is on "
                       "(parallelism.expert_parallel_comm_backend, default 'standard')",
        "fp8_saves_inputs": "sourced: torchao float8/float8_linear.py "
                            "matmul_with_hp_or_float8_args saves input_hp (the 16-bit input) "
                            "for the backward",
        "fused_norms": "sourced: torchtitan v0.2.2 models (llama3, qwen3, deepseek_v3) build "
                       "their norms as nn.RMSNorm (F.rms_norm, one kernel on GPU)",
        "scatter_combine": "sourced: torchtitan v0.2.2 models/moe/moe.py MoE.forward keeps an "
                           "fp32 copy of the routed rows for the scores (before the experts "
                           "by default, the bmm after them otherwise): as many bytes as the "
                           "index_add copy, kept as counted",
        "runs_traced_modules": _OWN_MODEL_CODE,
    },
    "megatron-lm": {
        "fsdp_root_holds_edges": "sourced: no ZeRO-3 (zero_stages 0 and 1)",
        "static_grad_buffer": "sourced: megatron/core/distributed/param_and_grad_buffer.py "
                              "(one contiguous main_grad buffer per model chunk, built with "
                              "the model; the distributed optimizer reduce-scatters in place "
                              "and shards only its fp32 copies: 'bf16 param, bf16 grads: "
                              "4 + 16/d bytes', docs/source/api-guide/dist_optimizer.md)",
        "stage_splits": "sourced: --pipeline-model-parallel-layout takes any layout "
                        "(megatron/core/transformer/pipeline_parallel_layer_layout.py)",
        "recompute_layers": "sourced: --recompute-granularity full --recompute-method block "
                            "--recompute-num-layers N: the first N layers of each stage "
                            "(megatron/core/recompute.py), or one granularity for all",
        "context_parallel": "sourced: Megatron-LM --context-parallel-size with "
                            "--cp-comm-type p2p (the default: ring attention in TE)",
        "hsdp": "sourced: Megatron-LM --num-distributed-optimizer-instances (the "
                "distributed optimizer sharded within an instance, gradients all-reduced "
                "across instances): HSDP of zero 1",
        "offloads": "sourced: Megatron-LM --optimizer-cpu-offload (optimizer state on the "
                    "CPU); parameters stay on the GPU",
        "dtypes": "sourced: Megatron-LM --bf16 / --fp16 and --fp8-format (Transformer "
                  "Engine fp8 linears)",
        "cp_comm": "sourced: Megatron-LM --cp-comm-type p2p (the default): TE's ring "
                   "attention, K/V exchange overlapped with attention",
        "ep_with_cp": "sourced: Megatron-Core MoE README (parallel folding: EP with CP, "
                      "e.g. CP=8, EP=8 on 64 GPUs)",
        "moe_zero_stages": "sourced: the distributed optimizer shards the experts' state over "
                           "their own data-parallel group (Megatron-Core MoE README)",
        "offload_optimizer_moves_params": "sourced: Megatron-LM --optimizer-cpu-offload "
                                          "moves the optimizer state only",
        "expert_gemm_calls": "sourced: Megatron-LM --moe-grouped-gemm (TEGroupedMLP, in "
                             "examples/mixtral/train_mixtral_8x7b_distributed.sh): 0",
        "expert_tensor_parallel": "sourced: Megatron-Core ModelParallelConfig."
                                  "expert_tensor_parallel_size defaults to "
                                  "tensor_model_parallel_size",
        "expert_tp_folded": "sourced: off unless the 'expert-tp-1' setting is on "
                            "(--expert-tensor-parallel-size defaults to the tp size)",
        "fold_needs_ep": "sourced: megatron/core/parallel_state.py builds the expert groups "
                         "from expert_tensor_parallel_size at any ep, ep 1 included",
        "moe_sequence_parallel": "sourced: megatron/core/transformer/moe/moe_layer.py "
                                 "(training with tp > 1 and MoE expects sequence "
                                 "parallelism)",
        "moe_tp": "sourced: megatron/core/transformer/moe/token_dispatcher.py "
                  "MoEAlltoAllTokenDispatcher (the exporter's --moe-token-dispatcher-type "
                  "alltoall): with expert tp > 1 dispatch_postprocess all-gathers the rows "
                  "over tp and combine_preprocess reduce-scatters them (at the probs' dtype, "
                  "the training dtype unless --moe-router-dtype); the shared experts "
                  "(SharedExpertMLP) are tp-parallel linears of their own; moe_layer.py "
                  "raises in training with tp > 1 and no sequence parallelism",
        "attention_kernel": "sourced: Megatron-Core's TEDotProductAttention (Transformer "
                            "Engine): cuDNN fused attention or FlashAttention-3 on Hopper",
        "fused_swiglu": "sourced: Megatron-LM --swiglu with bias_swiglu_fusion on by default "
                        "(--no-bias-swiglu-fusion turns it off): megatron/core/fusions/"
                        "fused_bias_swiglu.py keeps the fc1 output and recomputes silu in the "
                        "backward",
        "native_gqa": "sourced: Megatron-Core's TEDotProductAttention passes "
                      "num_gqa_groups to Transformer Engine, whose fused and flash kernels "
                      "read the kv heads in place",
        "moe_force_balance": "sourced: off unless the 'moe-force-balance' setting is on "
                             "(--moe-router-force-load-balancing, default off)",
        "ep_dispatch": "sourced: the alltoall token dispatcher (--moe-token-dispatcher-type "
                       "default) unless the 'ep-deepep' setting is on",
        "fp8_saves_inputs": "sourced: Transformer Engine pytorch/module/linear.py, "
                            "layernorm_linear.py, grouped_linear.py: an fp8 linear saves its "
                            "quantized input (column-wise fp8 data, 'Discard row-wise data "
                            "since it is not needed in backward pass') for the weight gradient",
        "fused_norms": "sourced: Megatron-Core's Transformer Engine layers (TENorm, "
                       "LayerNormLinear; the qk-layernorm too) run fused norm kernels that "
                       "keep their input and 1/rms",
        "scatter_combine": "sourced: megatron/core/transformer/moe/moe_utils.py unpermute "
                           "(and TE's fused moe_unpermute) weights the expert outputs by the "
                           "probabilities and scatter_add_s them back: the outputs are kept, "
                           "no index_add copy",
        "runs_traced_modules": _OWN_MODEL_CODE,
    },
    "deepspeed": {
        "fsdp_root_holds_edges": "sourced: deepspeed/runtime/zero/partitioned_param_coordinator"
                                 ".py gathers each module's parameters when it runs, in "
                                 "buckets (stage3_max_live_parameters), no root unit",
        "static_grad_buffer": "sourced: deepspeed/runtime/zero/stage_1_and_2.py (16-bit .grad "
                              "tensors from the backward, reduced and freed at the "
                              "accumulation boundary)",
        "stage_splits": "sourced: deepspeed/runtime/pipe/module.py _partition_layers: "
                        "partition_method 'uniform' (runtime/utils.py partition_uniform) or "
                        "'type:<regex>' (partition_balanced over 0/1 weights; "
                        "Megatron-DeepSpeed's default 'type:transformer'), no explicit bounds",
        "recompute_layers": "sourced: PipelineModule activation_checkpoint_interval and "
                            "Megatron-DeepSpeed --checkpoint-activations: every layer alike",
        "context_parallel": "sourced: DeepSpeed has no ring-attention context parallelism "
                            "(DeepSpeed-Ulysses shards heads with all-to-all instead)",
        "hsdp": "sourced: DeepSpeed ZeRO shards over the whole data-parallel group (ZeRO++ "
                "hpZ keeps a secondary copy, not replicas of a shard group)",
        "offloads": "sourced: deepspeed.ai config-json zero_optimization.offload_optimizer "
                    "and offload_param (stage 3)",
        "dtypes": "sourced: deepspeed.ai config-json bf16 / fp16 sections; no fp8 training",
        "cp_comm": "sourced: no ring-attention context parallelism (above); unused",
        "ep_with_cp": "sourced: no context parallelism (above)",
        "moe_zero_stages": "sourced: DeepSpeed 0.19.8 runtime/engine.py "
                           "_configure_zero_optimizer: 'Native DeepSpeed MoE is not supported "
                           "with ZeRO Stage 3' (deepspeed.moe.layer.MoE, what the export names)",
        "offload_optimizer_moves_params": "sourced: deepspeed.ai config-json "
                                          "offload_optimizer keeps the 16-bit parameters on "
                                          "the GPU",
        "expert_gemm_calls": "sourced: deepspeed/moe/experts.py Experts.forward loops over "
                             "its local expert modules (a SwiGLU expert: 3 linears)",
        "expert_tensor_parallel": "sourced: deepspeed/moe/layer.py MoE("
                                  "enable_expert_tensor_parallelism=False) by default: experts "
                                  "whole on every tensor-parallel rank",
        "expert_tp_folded": "sourced: deepspeed/moe/layer.py: ep groups are cut from the "
                            "data-parallel ranks (groups._create_expert_and_data_parallel), "
                            "experts whole on every tp rank: not folded",
        "fold_needs_ep": "sourced: no folding (expert_tp_folded)",
        "moe_sequence_parallel": "sourced: no sequence parallelism (sequence_parallel=False)",
        "moe_tp": "sourced: deepspeed/moe/layer.py MoE keeps experts whole on every tp "
                  "rank by default (expert_tensor_parallel): only the listed linears' calls",
        "attention_kernel": "sourced: Megatron-DeepSpeed --use-flash-attn-v2 "
                            "(FlashAttention-2's kernels)",
        "fused_swiglu": "sourced: Megatron-DeepSpeed's swiglu is eager (torch.chunk, "
                        "F.silu(x[0]) * x[1])",
        "native_gqa": "sourced: Megatron-DeepSpeed megatron/model/transformer.py "
                      "ParallelAttention repeats K/V (repeat_kv, 'Repeat kv' under use_gqa) "
                      "before the attention kernel",
        "moe_force_balance": "sourced: deepspeed/moe/sharded_moe.py gates route by top-k "
                             "with a capacity; nothing forces the balance",
        "ep_dispatch": "sourced: deepspeed/moe/sharded_moe.py _AllToAll (torch "
                       "all_to_all_single of the dispatched rows)",
        "fp8_saves_inputs": "sourced: no fp8 training (dtypes above)",
        "fused_norms": "sourced: Megatron-DeepSpeed's LayerNorm is apex's "
                       "MixedFusedLayerNorm (megatron/model/fused_layer_norm.py)",
        "scatter_combine": "sourced: deepspeed/moe/sharded_moe.py MOELayer combines with "
                           "einsum('sec,ecm->sm'), keeping the expert outputs and the dense "
                           "combine weights: no less than the index_add copy, kept as counted",
        "runs_traced_modules": _OWN_MODEL_CODE,
    },
}


def supports_dimensions(fw: Any, config: Any) -> str | None:
    """Why framework ``fw`` cannot run the config's cp, HSDP, offload or dtype (None: it can)."""
    if config.cp > 1 and not fw.context_parallel:
        return f"{fw.name} runs no context parallelism; use cp=1"
    if config.dp_replicate > 1 and not fw.hsdp:
        return f"{fw.name} runs no HSDP; use dp_replicate=1"
    if config.dp_replicate > 1 and config.zero not in fw.zero_stages:
        return f"{fw.name} runs ZeRO stages {fw.zero_stages}, not zero={config.zero}"
    if config.offload not in fw.offloads:
        return f"{fw.name} offloads {', '.join(fw.offloads)}, not {config.offload!r}"
    if config.dtype not in fw.dtypes:
        others = [name for name, dims in DIMENSIONS.items() if config.dtype in dims["dtypes"]]
        where = f", or plan for --framework {' or '.join(others)}" if others else ""
        return (f"{fw.name} trains in {', '.join(fw.dtypes)}, not {config.dtype}; use one of "
                f"those{where}")
    return None
