"""How the server reaches the model: ``thread`` (the model on a thread of the server), or
``process`` (the server's side) and ``worker`` (the engine process's side) speaking ``messages``."""
