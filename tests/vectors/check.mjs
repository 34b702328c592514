// Checks the hash scheme's test vectors with the `canonicalize` package (RFC 8785, by one
// of its authors): for each vector, the digest computed here from the payload's JSON text
// as sent must be the one the inbox stores.
//   node check.mjs [vectors.json]      (default: docs/reference/hash-vectors.json)
import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import canonicalize from "canonicalize";

const path = process.argv[2] ??
  fileURLToPath(new URL("../../docs/reference/hash-vectors.json", import.meta.url));
const { vectors } = JSON.parse(readFileSync(path, "utf8"));
let failed = 0;
for (const vector of vectors) {
  const canonical = canonicalize(JSON.parse(vector.json));
  const sha256 = createHash("sha256").update(canonical, "utf8").digest("hex");
  if (canonical !== vector.canonical || sha256 !== vector.sha256) {
    failed += 1;
    console.log(`MISMATCH ${vector.name}: ${canonical} ${sha256}`);
  }
}
console.log(`${vectors.length - failed} vectors agree, ${failed} differ`);
process.exit(failed || vectors.length === 0 ? 1 : 0);
