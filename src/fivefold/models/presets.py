"""Named model sizes shared by `fivefold train`, `plan` and `simulate`.

Each preset is a plain dict of `model.*` keys (see docs/run_spec.md); a config
may override any key one by one. Dense shapes follow the published models they are named
after (Llama 3 / 3.1 / 3.2 for 1B, 8B, 70B, 405B; GPT-3 "small" and "medium" widths with a
Llama block for 125M and 350M). `tiny` is the default: small enough that the built-in corpus
trains to a visibly lower loss in a few minutes on two CPU cores.
"""

PRESETS: dict[str, dict] = {
    "tiny": dict(layers=4, hidden=256, heads=8, kv_heads=4, ffn_hidden=704, vocab=8192,
                 seq_len=256, tied_embeddings=True, rope_theta=10000.0),
    "125M": dict(layers=12, hidden=768, heads=12, kv_heads=12, ffn_hidden=2048, vocab=32000,
                 seq_len=2048, tied_embeddings=True, rope_theta=10000.0),
    "350M": dict(layers=24, hidden=1024, heads=16, kv_heads=16, ffn_hidden=2816, vocab=32000,
                 seq_len=2048, tied_embeddings=True, rope_theta=10000.0),
    "1B": dict(layers=16, hidden=2048, heads=32, kv_heads=8, ffn_hidden=8192, vocab=128256,
               seq_len=2048, tied_embeddings=True, rope_theta=500000.0),
    "8B": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256,
               seq_len=8192, tied_embeddings=False, rope_theta=500000.0),
    "70B": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256,
                seq_len=8192, tied_embeddings=False, rope_theta=500000.0),
    "405B": dict(layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248,
                 vocab=128256, seq_len=8192, tied_embeddings=False, rope_theta=500000.0),
    # Mixture-of-experts shapes (docs/moe.md): Mixtral 8x7B (arXiv 2401.04088), and
    # DeepSeek-V3's MoE (arXiv 2412.19437, Sec. 4.2: 3 dense layers, then 1 shared and 256
    # routed experts of width 2048, top-8 of sigmoid scores, bias balancing) around plain
    # multi-head attention in place of its multi-head latent attention, without its
    # multi-token-prediction module.
    "mixtral-8x7B": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                         vocab=32000, seq_len=4096, tied_embeddings=False, rope_theta=1e6,
                         moe=dict(experts=8, top_k=2, expert_ffn_hidden=14336)),
    "deepseek-v3-like": dict(layers=61, hidden=7168, heads=128, kv_heads=128,
                             ffn_hidden=18432, vocab=129280, seq_len=4096,
                             tied_embeddings=False, rope_theta=10000.0,
                             moe=dict(experts=256, top_k=8, expert_ffn_hidden=2048,
                                      shared_experts=1, dense_layers=3, score="sigmoid",
                                      bias_update_rate=0.001)),
}
