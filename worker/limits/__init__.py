"""Jobs as strangers (DESIGN.md section 15): the user an `--exec` job runs as, its kernel
limits, the cgroup it may get, what it used, and what it leaves behind.

`jail` starts a job under all of them; `users`, `rlimits`, `cgroups`, `processes` and
`leftovers` each hold one side of it.
"""
