"""What a training specification is and whether it holds together field by field: its tables (`tables`), the
dataclass machinery behind them (`schema`), reading spec files and ``--set`` overrides (`files`), the sinks and
profiler tables (`sinks`), the backends' option tables (`backend_options`), model-parallel layouts (`layout`), the
model zoo (`zoo`), losses and metrics by name (`objectives`), the user's own code named by import path (`user_code`).
Loading a spec whole, checked against the registry, is `polytrain.validation`."""
