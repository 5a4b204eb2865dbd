"""Course tooling for instructors and CI, run from the repository root; not part of the installed dslab package."""
