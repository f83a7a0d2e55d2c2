"""Built-in analyzers; each module is one plugin, registered through the ``lensdiv.plugins`` group."""
