"""The runnable benchmark suites (``*.sh``) and the programs they run; importable from the
repository root so that their tests can reach them. The library they share is
``jaxpaged.benchmarks``."""
