import { InvalidArgumentError, RetrievalClient } from "../src"; // "@retrieval/client" from another package

async function main(): Promise<void> {
  const target = process.env.RETRIEVAL_TARGET ?? "127.0.0.1:50051"; // make run
  const client = new RetrievalClient(target, { apiKey: process.env.RETRIEVAL_API_KEY ?? "" });
  try {
    // No timeoutMs here: the client's default deadline (10 s) applies.
    const attempt = await client.retrieve("how do I reset my password", { topK: 3 });
    if (attempt.outcome.isInfrastructureFailure()) {
      // TIMEOUT / BACKEND_ERROR: not "no evidence"
      throw new Error(`retrieval failed: ${attempt.outcome.name}`);
    }
    for (const e of attempt.evidence) console.log(e.rank, e.evidenceId, e.title);
    console.log("outcome:", attempt.outcome.name);

    // The agent projection, ready to hand to an LLM as a tool result.
    const tool = await client.lookup("如何开具发票", { topK: 1, toolCallId: "call-1" });
    console.log(JSON.stringify(tool));
  } catch (err) {
    if (err instanceof InvalidArgumentError) console.error("bad fields:", err.fields);
    throw err;
  } finally {
    client.close();
  }
}

void main().catch(() => {
  process.exitCode = 1;
});
