"""The ``polytrain`` subcommands beside ``train`` and ``launch``: ``info``, ``compare`` (`compare`, its reader
`compare_runs`), ``sweep``, ``plot`` and ``checkpoint inspect|convert|import`` (`checkpoint`). ``plan`` is
`polytrain.plan`."""
