// edged's MQTT output read as a Node-RED flow reads it: mqtt.js (Node-RED's MQTT client, a stack other
// than edged's paho), JSON.parse, and ajv validating against edged/messages.schema.json. Run by
// tests/test_mqtt_interop.py as one process holding any number of named clients: it reads one JSON
// command a line on stdin and prints one JSON line per event on stdout, and the test asserts on them.
// Commands:
//   {"op": "connect", name, url, options, subscribe: [topic filters], ca_file?, qos?}
//       mqtt.connect(url, options) (with ca read from ca_file); subscribes on every connection that
//       has no session (as a flow's mqtt-in node does), at qos (default 1)
//   {"op": "publish", name, topic, payload, qos, retain}
//   {"op": "end", name}   a clean disconnect: a persistent session stays on the broker
//   {"op": "quit"}
// Events:
//   {"event": "connect", name, session_present}      {"event": "subscribed", name, granted}
//   {"event": "message", name, topic, qos, retain, dup, utf8, json, text?, schema_errors?, message?}
//   {"event": "published", name, topic}   {"event": "ended", name}   {"event": "error", name, error}
"use strict";

const fs = require("fs");
const readline = require("readline");
const mqtt = require("mqtt");
const Ajv2020 = require("ajv/dist/2020");
const addFormats = require("ajv-formats");

const args = JSON.parse(process.argv[2]);
const print = (line) => process.stdout.write(JSON.stringify(line) + "\n");

const ajv = new Ajv2020({ strict: true, allErrors: true });
addFormats(ajv);
const validate = ajv.compile(JSON.parse(fs.readFileSync(args.schema, "utf8")));

function inspect(name, topic, payload, packet) {
  const line = { event: "message", name, topic, qos: packet.qos, retain: packet.retain, dup: packet.dup };
  let text;
  try {
    text = new TextDecoder("utf-8", { fatal: true }).decode(payload);
    line.utf8 = true;
  } catch (e) {
    line.utf8 = false;
    text = payload.toString("latin1");
  }
  let doc;
  try {
    doc = JSON.parse(text);
    line.json = typeof doc === "object" && doc !== null;
  } catch (e) {
    line.json = false;
  }
  if (!line.json) {
    line.text = text.slice(0, 2000);
    return line;
  }
  line.schema_errors = validate(doc) ? [] : validate.errors.map((e) => `${e.instancePath} ${e.message} ${JSON.stringify(e.params)}`);
  line.message = doc;
  return line;
}

const clients = new Map();

function connect(command) {
  const options = { ...command.options };
  if (command.ca_file) options.ca = fs.readFileSync(command.ca_file);
  const client = mqtt.connect(command.url, options);
  const name = command.name;
  clients.set(name, client);
  client.on("connect", (connack) => {
    print({ event: "connect", name, session_present: Boolean(connack.sessionPresent) });
    if (connack.sessionPresent) return; // the broker kept the subscriptions, and what came for them
    client.subscribe(command.subscribe, { qos: command.qos ?? 1 }, (err, granted) => {
      if (err) print({ event: "error", name, error: String(err) });
      else print({ event: "subscribed", name, granted: granted.map((g) => [g.topic, g.qos]) });
    });
  });
  client.on("message", (topic, payload, packet) => print(inspect(name, topic, payload, packet)));
  client.on("error", (err) => print({ event: "error", name, error: String(err) }));
}

const commands = {
  connect,
  publish(command) {
    const client = clients.get(command.name);
    const options = { qos: command.qos ?? 1, retain: Boolean(command.retain) };
    client.publish(command.topic, command.payload, options, (err) => {
      if (err) print({ event: "error", name: command.name, error: String(err) });
      else print({ event: "published", name: command.name, topic: command.topic });
    });
  },
  end(command) {
    const client = clients.get(command.name);
    clients.delete(command.name);
    client.end(false, {}, () => print({ event: "ended", name: command.name }));
  },
  quit() {
    for (const client of clients.values()) client.end(true);
    process.exit(0);
  },
};

readline.createInterface({ input: process.stdin }).on("line", (line) => {
  const command = JSON.parse(line);
  try {
    commands[command.op](command);
  } catch (e) {
    print({ event: "error", name: command.name, error: String(e && e.stack ? e.stack : e) });
  }
});
