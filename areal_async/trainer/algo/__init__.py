"""The RL algorithm as math on tensors: rewards and advantages, the PPO policy loss (decoupled objective),
off-policy corrections, and the behaviour/proximal mismatch block. Imports no other trainer subroom."""
