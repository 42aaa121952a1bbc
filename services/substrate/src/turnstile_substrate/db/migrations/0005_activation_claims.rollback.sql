DROP TABLE IF EXISTS activation_claims;
