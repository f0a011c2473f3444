"""jaxshard benchmarks: planning speed and plan quality against the alternatives.

Run everything with ``python -m benchmarks.run`` (``--quick`` for a smoke run); see
``benchmarks/README.md``. Importing this package asks XLA for 8 simulated CPU devices
when the caller has not chosen a device count, so it must happen before JAX is imported.
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
