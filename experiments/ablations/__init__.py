"""Ablations of K3's claims (the notebooks under notebooks/): training config variants side by side and reading
their histories (`runs`), MoE balancing on skewed data (`balance`), KDA gate timing and long-T finiteness (`gate`),
AttnRes depth weights of a trained model (`residual`), forward throughput against length (`throughput`), SFT then
GRPO runs and their held-out success (`rl`)."""
