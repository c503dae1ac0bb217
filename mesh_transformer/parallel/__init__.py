"""How the model is split over a ('dp', 'mp') device mesh: one table, a few collectives.

    mesh.py    the mesh, and (dp, mp) from a config and flags
    rules.py   logical axes -> mesh axes (MEGATRON, ZERO), derived from what each parameter declares
    manual.py  inside shard_map: parameters as local shards (`param`, `weight`) and the collectives
"""
from mesh_transformer.parallel.manual import (LORA_A, LORA_B, SCALE, AdapterBank, BankPlan, InputsLast, LoRAPlan, LoRAWeight, Quantized, all_gather_mp, dp_index, fused, is_adapter, lora_plan, infos_for, manual_axes, mp_index,  # noqa: F401
                                              mp_size, param, pmax_mp, psum_dp, psum_mp, recording, shard_map,
                                              quantize, weight, expert_weights, adapter_bank, bank_infos, vary,
                                              vary_alike, varying)
from mesh_transformer.parallel.mesh import DP, MP, make_mesh, mesh_for, mesh_shape  # noqa: F401
from mesh_transformer.parallel.rules import (MEGATRON, ZERO, Layout, ParamInfo, bytes_of, check_divisibility,  # noqa: F401
                                             decay_mask, inputs_last_order, leaf_axes, named, param_specs,
                                             rules_for, spec_for, split_alike, stored_layout)
