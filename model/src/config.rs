//! The bounds of one model configuration.

/// The bounds of one model configuration. Every bound is a budget the world spends, which is
/// what keeps every path finite and acyclic (see docs/model.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Number of real targets (the controller also has `None`).
    pub targets: u8,
    /// Calls the controller may make (`SetTarget`, and `Shutdown` when enabled).
    pub retargets: u8,
    /// Build failures the world may inject (over the whole run).
    pub failures: u8,
    /// Requests, each one load, dispatch or bypass, finish.
    pub requests: u8,
    /// Whether the controller may shut the hop down (once, at any time; it spends a retarget).
    pub shutdown: bool,
    /// Admission changes the world may make: each empties the admission set of one retired
    /// binding (upstream publishes an empty set before dropping a retired binding's sender).
    pub admission_changes: u8,
}

impl Config {
    /// The standard configuration: targets {None, A, B}, 4 retargets, builds that may
    /// fail twice, 2 concurrent requests, shutdown possible, one admission change.
    pub const STANDARD: Config = Config {
        targets: 2,
        retargets: 4,
        failures: 2,
        requests: 2,
        shutdown: true,
        admission_changes: 1,
    };

    /// Checks the bounds: build ids must fit the model's 64-bit masks.
    pub fn validate(&self) -> Result<(), String> {
        // Each StartBuild follows a SetTarget or a failure's retry, so ids stay <= their sum.
        let max_builds = u32::from(self.retargets) + u32::from(self.failures);
        if max_builds > 62 {
            return Err(format!(
                "retargets + failures = {max_builds}: at most 62 builds fit the model's masks"
            ));
        }
        if self.targets == 0 || self.targets > 26 {
            return Err("targets must be 1..=26".into());
        }
        Ok(())
    }
}

impl Default for Config {
    fn default() -> Self {
        Config::STANDARD
    }
}
