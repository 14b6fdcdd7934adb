"""Small helpers shared by the library (plug-in loading, ...). Importing this is cheap."""
