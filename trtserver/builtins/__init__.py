"""Default plugins, written exactly as plugins outside trtserver are: hookimpls registered at start-up."""
