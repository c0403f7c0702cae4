"""Code the tests share: helpers imported by test modules and scripts they run in subprocesses."""
