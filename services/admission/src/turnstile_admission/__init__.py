"""The admission service: may this client activate this sandbox now? (SPEC P1–P7)"""
