// edged's ZeroMQ stream read as a JavaScript dashboard or Node-RED flow reads it: zeromq.js (its own
// libzmq), JSON.parse, and ajv validating against edged/messages.schema.json. Run by
// tests/test_stream_interop.py with one JSON argument; prints one JSON line per event, and the test
// asserts on them:
//   {"event": "message", topic, frames, utf8, json, kind, seq, camera_id, schema_errors, twins, message}
//   {"event": "refused", client, type}    a client without an allowed key, as its handshake fails
//   {"event": "receiving"}                 the client to be revoked and the main one both receive, or
//                                          a seq reached restart_after
//   {"event": "restarted", topic, last, seq}  a seq lower than the one before: edged started again
//   {"event": "done", received, refused_messages, revoked_after} or {"event": "timeout", received}
// Arguments: endpoint, subscriptions (topic prefixes), want (messages per topic kind), timeout_ms,
// schema (path), and with CURVE: server_key (the publisher's .key), client_key (an allowed
// .key_secret), refused_key (a .key_secret not allowed), plaintext (a client without keys too) and
// revoked_key (an allowed .key_secret the test revokes once told "receiving"); restart_after (a seq
// after which the test restarts edged, the client staying connected).
"use strict";

const fs = require("fs");
const zmq = require("zeromq");
const Ajv2020 = require("ajv/dist/2020");
const addFormats = require("ajv-formats");

const args = JSON.parse(process.argv[2]);
const print = (line) => process.stdout.write(JSON.stringify(line) + "\n");

// A ZeroMQ certificate (docs/outputs.md, "Securing the stream"): `public-key = "Z85"` and, in a
// .key_secret, `secret-key = "Z85"`, the 40-character Z85 text zeromq.js takes as it is.
function certificate(path) {
  const text = fs.readFileSync(path, "utf8");
  const field = (name) => {
    const found = text.match(new RegExp(`^\\s*${name}\\s*=\\s*"([^"]{40})"\\s*$`, "m"));
    return found ? found[1] : null;
  };
  return { publicKey: field("public-key"), secretKey: field("secret-key") };
}

function curveOptions(clientKeyFile) {
  const server = certificate(args.server_key);
  const client = certificate(clientKeyFile);
  if (!server.publicKey || !client.publicKey || !client.secretKey) {
    throw new Error(`no Z85 keys in ${args.server_key} or ${clientKeyFile}`);
  }
  return { curveServerKey: server.publicKey, curvePublicKey: client.publicKey, curveSecretKey: client.secretKey };
}

const ajv = new Ajv2020({ strict: true, allErrors: true });
addFormats(ajv);
const validate = ajv.compile(JSON.parse(fs.readFileSync(args.schema, "utf8")));

// Every "X_ns": integer in the payload's text, exact (a BigInt), against its "X_ms" twin as parsed.
function twins(text, doc) {
  const found = [];
  const walk = (value) => {
    if (Array.isArray(value)) return value.forEach(walk);
    if (value === null || typeof value !== "object") return;
    for (const [key, inner] of Object.entries(value)) {
      if (key.endsWith("_ns")) {
        const raw = [...text.matchAll(new RegExp(`"${key}"\\s*:\\s*(-?\\d+)`, "g"))].map((m) => m[1]);
        const twin = key.slice(0, -3) + "_ms";
        const ms = value[twin];
        const entry = { field: key, raw, twin_present: twin in value, ms_type: typeof ms };
        if (raw.length === 1 && typeof ms === "number") {
          const exact = BigInt(raw[0]);
          entry.diff_ns = Number(BigInt(Math.round(ms * 1e6)) - exact);
          entry.parsed_ns_exact = BigInt(inner) === exact; // what JSON.parse makes of the ns itself
        }
        found.push(entry);
      }
      walk(inner);
    }
  };
  walk(doc);
  return found;
}

function inspect(topicFrame, payloadFrame) {
  const line = { event: "message", topic: topicFrame.toString("latin1") };
  let text;
  try {
    text = new TextDecoder("utf-8", { fatal: true }).decode(payloadFrame);
    line.utf8 = true;
  } catch (e) {
    line.utf8 = false;
    text = payloadFrame.toString("latin1");
  }
  let doc;
  try {
    doc = JSON.parse(text);
    line.json = true;
  } catch (e) {
    line.json = false;
    line.json_error = String(e.message);
    line.text = text.slice(0, 2000);
    return line;
  }
  line.kind = doc.kind;
  line.seq = doc.seq;
  line.camera_id = doc.camera_id;
  line.schema_errors = validate(doc) ? [] : validate.errors.map((e) => `${e.instancePath} ${e.message} ${JSON.stringify(e.params)}`);
  line.twins = twins(text, doc);
  line.message = doc;
  return line;
}

async function main() {
  const received = {};
  const done = () => Object.keys(args.want).every((kind) => (received[kind] || 0) >= args.want[kind]);
  const sockets = [];
  let refusedMessages = 0;
  let refusalsLeft = 0;
  let finish;
  let over = false; // set once finished: what arrives while the sockets close is not reported
  const finished = new Promise((resolve) => (finish = resolve));
  const check = () => done() && refusalsLeft === 0 && finish("done");
  const count = (kind) => {
    // after the revocation, or the restart, only
    if ((!revoked || revoked.refused) && (!restart || restart.seen)) received[kind] = (received[kind] || 0) + 1;
    check();
  };
  // edged restarted while the client stays (restart_after): "receiving" once a seq reaches restart_after,
  // for the test to restart it; "restarted" at the first seq lower than the one before on its topic.
  const restart = args.restart_after === undefined ? null : { told: false, seen: false, last: {} };
  const follow = (line) => {
    if (!restart) return;
    if (!restart.told && line.seq >= args.restart_after) {
      restart.told = true;
      print({ event: "receiving" });
    }
    const last = restart.last[line.topic];
    if (!restart.seen && last !== undefined && line.seq < last) {
      restart.seen = true;
      print({ event: "restarted", topic: line.topic, last, seq: line.seq });
    }
    restart.last[line.topic] = line.seq;
  };

  const subscriber = new zmq.Subscriber(args.server_key ? curveOptions(args.client_key) : {});
  sockets.push(subscriber);
  subscriber.connect(args.endpoint);
  for (const topic of args.subscriptions) subscriber.subscribe(topic);

  // Clients the publisher must refuse: each is done once its handshake failed, and must receive nothing.
  const refused = [];
  if (args.refused_key) refused.push(["not allowed", curveOptions(args.refused_key)]);
  if (args.plaintext) refused.push(["plaintext", {}]);
  for (const [name, options] of refused) {
    const sock = new zmq.Subscriber(options);
    sockets.push(sock);
    refusalsLeft += 1;
    let told = false;
    sock.events.on("handshake:error:auth", (event) => tell(event));
    sock.events.on("handshake:error:protocol", (event) => tell(event));
    sock.events.on("handshake:error:other", (event) => tell(event));
    const tell = (event) => {
      if (told) return;
      told = true;
      print({ event: "refused", client: name, type: event.type });
      refusalsLeft -= 1;
      check();
    };
    sock.connect(args.endpoint);
    sock.subscribe("");
    (async () => {
      for await (const _ of sock) if (!over) refusedMessages += 1;
    })().catch(() => {});
  }

  // A client whose key is revoked while it receives (revoked_key): once it and the main client have
  // messages, "receiving" tells the test to remove its key and reload edged. Its reconnection is then
  // refused, and from then on it must receive nothing, while the main client reconnects by itself and
  // receives `want` more.
  let revoked = null;
  if (args.revoked_key) {
    const sock = new zmq.Subscriber(curveOptions(args.revoked_key));
    sockets.push(sock);
    revoked = { received: 0, after: 0, refused: false };
    refusalsLeft += 1;
    sock.events.on("handshake:error:auth", (event) => {
      if (revoked.refused) return;
      revoked.refused = true;
      print({ event: "refused", client: "revoked", type: event.type });
      refusalsLeft -= 1;
      check();
    });
    sock.connect(args.endpoint);
    sock.subscribe("");
    (async () => {
      for await (const _ of sock) {
        if (over) break;
        if (revoked.refused) revoked.after += 1;
        else if (++revoked.received === 1) announce();
      }
    })().catch(() => {});
  }
  let announced = false;
  const announce = () => {
    if (announced || !revoked || !revoked.received || !mainReceived) return;
    announced = true;
    print({ event: "receiving" });
  };

  let mainReceived = 0;
  (async () => {
    for await (const frames of subscriber) {
      if (over) break;
      const line = inspect(frames[0], frames[1] || Buffer.alloc(0));
      line.frames = frames.length;
      follow(line);
      print(line);
      mainReceived += 1;
      announce();
      count(line.kind || "?");
    }
  })().catch((e) => print({ event: "error", error: String(e) }));

  const timer = setTimeout(() => finish("timeout"), args.timeout_ms);
  const outcome = await finished;
  over = true;
  clearTimeout(timer);
  print({ event: outcome, received, refused_messages: refusedMessages, revoked_after: revoked && revoked.after });
  for (const sock of sockets) sock.close();
}

main().catch((e) => {
  print({ event: "error", error: String(e && e.stack ? e.stack : e) });
  process.exit(1);
});
