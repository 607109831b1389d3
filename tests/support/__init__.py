"""Test helpers shared by the test files (and by benches/ and scripts/, which put tests/ on ``sys.path``):
tiny model builders, reference codecs and writers, the vLLM runner (a script run in its own process), the
llama.cpp fixtures. Test files import them as ``support.<module>``; pytest puts tests/ on ``sys.path``
(the test files sit in a folder without ``__init__.py``). The server health poll is the package's (``ternary_rs.serving.health``)."""
