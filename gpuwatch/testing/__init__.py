"""The test harness: real gpuwatch processes and the environment their children get, for the tests, the
tests/hardware scripts and the bench.

`daemon_process` starts a real `gpuwatch run` (or another local server) on a free loopback port with its
own config, state and runtime dirs, waits for it and stops it; `child_env` is the environment a child
starts with (this process's, without GPUWATCH_*); `run_gpuwatch` runs one CLI command. It ships in the
package because the bench measures daemons started this way (gpuwatch cannot import tests/); nothing
that runs on a node or in a job imports it.
"""
