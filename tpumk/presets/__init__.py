"""Model presets shipped with tpumk (one TOML file each, fields of tpumk.config.ModelConfig)."""
