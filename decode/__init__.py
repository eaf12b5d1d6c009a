"""decode: the runtime — load a target and a pool of arms, choose arms online, verify losslessly."""
