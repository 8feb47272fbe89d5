"""What the engine services (prefill, decode) share: ``base.EngineWorker``, an engine on its own
thread inside a mesh service, with its load reports, drain and expert-load link."""
