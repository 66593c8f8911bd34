"""``python -m bench.gpu``: the GPU check (see `bench.gpu.check`)."""

from bench.gpu.check import main

raise SystemExit(main())
