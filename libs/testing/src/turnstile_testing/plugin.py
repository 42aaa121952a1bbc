"""Pytest plugin of the Turnstile test kit, loaded by the root pytest config.

Placeholder so pytest starts; the test kit's owners add its fixtures and options here.
"""
