"""Synthetic metrics rows for the benchmark tests (no fleet is started)."""


def make_rows(
    n: int,
    step_s: float,
    train_s: float,
    publish_s: float = 0.0,
    rewards=None,
    batch: int = 128,
    start_wall: float = 30.0,
    gen_busy_per_step: float = 0.0,
    staleness: int = 0,
) -> list[dict]:
    rewards = rewards if rewards is not None else [0.5] * n
    return [
        {
            "step": i,
            "version": i + 1,
            "reward_mean": rewards[i],
            "staleness_max": staleness,
            "samples_trained": batch,
            "samples_trained_total": batch * (i + 1),
            "step_s": 25.0 if i == 0 else step_s,  # step 0 carries start-up and SFT warm-up
            "wall_s": start_wall + i * step_s,
            "gen_busy_s_total": gen_busy_per_step * (i + 1),
            "train_s": train_s,
            "publish_s": publish_s,
            "wait_data_s": 0.001,
        }
        for i in range(n)
    ]
