"""The C++ CPU kernels compiled at install time (setup.py), `<kernel>_<isa>`; loaded by
tokenmill.utils.cpp_extension."""
