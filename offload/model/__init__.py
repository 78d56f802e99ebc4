"""What a model is made of, read before anything moves: the transfer units (`blocks`: the repeated blocks of any
nn.Module, MoE experts), how a unit's tensors map onto one flat byte buffer (`layout`), the parameters inside the
blocks that train (`trainable`), non-persistent buffers of a meta-device model recomputed (`meta_buffers`), float8
weights with their scales (`fp8`), and conversions after offloading refused at the call (`model_changes`).

Layer: store/ and everything above read it. It imports nothing from offload/ but itself.
Used from outside: `blocks.find_units`, `blocks.Unit`, `blocks.expert_units`, `layout.plan_layout`,
`layout.unit_tensors`, `layout.TensorLayout`, `trainable.trainable_in_blocks`, `fp8.Fp8Linear`,
`model_changes.ModelChangedError`, `meta_buffers.materialize_non_persistent_buffers`.
"""
