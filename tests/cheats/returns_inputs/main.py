def run(codes, s_k, s_v, u, q, *rest):
    return codes, s_k, s_v, u, q
