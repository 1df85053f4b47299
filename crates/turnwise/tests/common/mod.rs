//! Shared test settings.

/// Overrides that shrink any preset to seconds.
#[allow(dead_code)]
pub fn tiny_overrides() -> Vec<String> {
    [
        "task.world.countries=4",
        "task.world.cities=8",
        "task.world.companies=6",
        "task.world.persons=16",
        "task.world.questions.train=40",
        "task.world.questions.validation=8",
        "task.world.questions.test=8",
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.intermediate_size=64",
        "sft.steps=3",
        "sft.batch_size=4",
        "rollout.prompts_per_step=2",
        "rollout.group_size=3",
        "rollout.max_turn_tokens=12",
        "rollout.max_response_tokens=120",
        "optim.mini_batch_size=3",
        "run.steps=2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}
