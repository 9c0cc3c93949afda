"""Layer shapes shared by the CPU-sized test models of the family maps (random init, no downloads)."""

# a hybrid stack: three GDN layers and one full-attention layer, hidden 64
TINY_GDN = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096, vocab_size=512,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)
# the experts of a mixture-of-experts family: 8 experts, top-2
TINY_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
                num_experts_per_tok=2)
