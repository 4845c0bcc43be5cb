"""Model presets shipped with tpumk (one TOML file each, fields of tpumk.model.config.ModelConfig)."""
