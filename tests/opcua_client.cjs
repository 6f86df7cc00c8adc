// An OPC UA client on node-opcua (the stack Node-RED's OPC UA nodes use), for tests/test_opcua_interop.py.
// `node opcua_client.cjs '{"scenario": ..., ...}'` prints one JSON line per thing it saw, each
// starting with {"event": ..., which the test parses; node-opcua's own warnings go to the same
// output and are not JSON lines. A scenario's failure is an "error" event and exit status 1.
"use strict";
const fs = require("fs");
const path = require("path");
const ua = require("node-opcua-client");
const { OPCUACertificateManager } = require("node-opcua-certificate-manager");

const args = JSON.parse(process.argv[2]);
const emit = (event, fields) => console.log(JSON.stringify({ event, ...fields }));
const VERDICT_STRING = "Verdict";
const SECURE = {
    securityMode: ua.MessageSecurityMode.SignAndEncrypt,
    securityPolicy: ua.SecurityPolicy.Basic256Sha256,
};

// The client's own PKI, trusting only what the test puts in trusted/certs: never the user's.
function certificates(root) {
    return new OPCUACertificateManager({ rootFolder: root, automaticallyAcceptUnknownCertificate: false });
}

function client(options) {
    return ua.OPCUAClient.create({
        applicationName: "edged-interop",
        connectionStrategy: { maxRetry: 0, initialDelay: 100, maxDelay: 200 },
        requestedSessionTimeout: 20000,
        clientCertificateManager: certificates(args.pki),
        ...options,
    });
}

// JSON for a node-opcua value: UInt64 is [high, low] there, a decimal string here.
function plain(variant) {
    if (variant.dataType === ua.DataType.UInt64 || variant.dataType === ua.DataType.Int64) {
        const [high, low] = variant.value;
        return (BigInt(high) * 4294967296n + BigInt(low)).toString();
    }
    return variant.value;
}

function described(dataValue) {
    return {
        status: dataValue.statusCode.name,
        type: ua.DataType[dataValue.value.dataType],
        value: plain(dataValue.value),
        source_ms: dataValue.sourceTimestamp ? dataValue.sourceTimestamp.getTime() : null,
        source_ps: dataValue.sourcePicoseconds || 0,
        server_ms: dataValue.serverTimestamp ? dataValue.serverTimestamp.getTime() : null,
    };
}

function endpoint(e) {
    return {
        url: e.endpointUrl,
        mode: ua.MessageSecurityMode[e.securityMode],
        policy: e.securityPolicyUri.split("#")[1],
        application_uri: e.server.applicationUri,
        tokens: e.userIdentityTokens.map((t) => ua.UserTokenType[t.tokenType]),
        certificate: e.serverCertificate ? e.serverCertificate.toString("base64") : null,
    };
}

async function endpoints(url) {
    const c = client({ endpointMustExist: false });
    await c.connect(url);
    try {
        emit("endpoints", { asked: url, endpoints: (await c.getEndpoints()).map(endpoint) });
    } finally {
        await c.disconnect();
    }
}

// One connection as a user would try it: ok, or the error node-opcua reports.
async function attempt(label, url, options, identity) {
    const c = client(options);
    try {
        await c.connect(url);
        const session = await c.createSession(identity);
        const state = await session.read({ nodeId: args.camera + ".State", attributeId: ua.AttributeIds.Value });
        await session.close();
        emit("attempt", { label, ok: true, state: state.value.value });
    } catch (e) {
        emit("attempt", { label, ok: false, error: String(e.message).split("\n")[0] });
    } finally {
        await c.disconnect();
    }
}

// Objects/edged/<camera>: browsed by browse name, in the namespace edged's URI has here.
async function browse(session) {
    const namespaces = await session.readNamespaceArray();
    const ns = namespaces.indexOf("urn:edged");
    const under = async (nodeId) => (await session.browse(nodeId)).references;
    const objects = await under("ObjectsFolder");
    const root = objects.find((r) => r.browseName.name === "edged" && r.browseName.namespaceIndex === ns);
    const cameras = await under(root.nodeId);
    const camera = cameras.find((r) => r.browseName.name === args.camera_id);
    const children = (await under(camera.nodeId)).map((r) => ({
        browse_name: r.browseName.name,
        ns: r.browseName.namespaceIndex,
        display_name: r.displayName.text,
        node_class: ua.NodeClass[r.nodeClass],
        node_id: r.nodeId.toString(),
    }));
    emit("browse", { namespaces, ns, root: root.nodeId.toString(), camera: camera.nodeId.toString(), children });
    return children;
}

async function readAll(session, children, phase) {
    const values = {};
    for (const child of children.filter((c) => c.node_class === "Variable")) {
        const value = await session.read({ nodeId: child.node_id, attributeId: ua.AttributeIds.Value });
        const type = await session.read({ nodeId: child.node_id, attributeId: ua.AttributeIds.DataType });
        const access = await session.read({ nodeId: child.node_id, attributeId: ua.AttributeIds.AccessLevel });
        values[child.browse_name] = {
            ...described(value),
            data_type: type.value.value.toString(),
            access_level: access.value.value,
        };
    }
    emit("read", { phase, values, now_ms: Date.now() });
}

// Data changes of `names`, each an event; Verdict with the StatusValueTimestamp trigger, as the docs
// tell a client that wants every verdict of a run of NG parts.
async function subscribe(session, names) {
    const subscription = await session.createSubscription2({
        requestedPublishingInterval: 50,
        requestedMaxKeepAliveCount: 20,
        requestedLifetimeCount: 600,
        publishingEnabled: true,
    });
    const changes = [];
    for (const name of names) {
        const filter =
            name === VERDICT_STRING
                ? new ua.DataChangeFilter({ trigger: ua.DataChangeTrigger.StatusValueTimestamp })
                : null;
        const item = await subscription.monitor(
            { nodeId: `${args.camera}.${name}`, attributeId: ua.AttributeIds.Value },
            { samplingInterval: 0, queueSize: 20, discardOldest: true, filter },
            ua.TimestampsToReturn.Both
        );
        item.on("changed", (dataValue) => {
            const change = { name, ...described(dataValue) };
            changes.push(change);
            emit("change", change);
        });
    }
    return { subscription, changes };
}

async function until(predicate, timeoutMs, what) {
    const deadline = Date.now() + timeoutMs;
    while (!predicate()) {
        if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
        await new Promise((resolve) => setTimeout(resolve, 20));
    }
}

async function call(session, label, objectId, inputArguments) {
    const result = await session.call({ objectId, methodId: `${args.camera}.Trigger`, inputArguments });
    emit("call", {
        label,
        status: result.statusCode.name,
        input_results: (result.inputArgumentResults || []).map((s) => s.name),
        output: (result.outputArguments || []).map((v) => ({ type: ua.DataType[v.dataType], value: v.value })),
    });
}

const sequences = (changes) => changes.filter((c) => c.name === "Sequence" && c.status === "Good");

// Anonymous, security None: browse, read, subscribe on one session while another calls Trigger.
async function anonymous() {
    await endpoints(args.url);
    const reader = client({});
    const watcher = client({});
    await reader.connect(args.url);
    await watcher.connect(args.url);
    const session = await reader.createSession();
    const watching = await watcher.createSession();
    const children = await browse(session);
    await readAll(session, children, "before");
    const { subscription, changes } = await subscribe(watching, ["Sequence", VERDICT_STRING, "LastMessage"]);
    await until(() => changes.filter((c) => c.name === "Sequence").length >= 1, 10000, "the subscription's first value");
    const camera = args.camera;
    const string = (value) => ({ dataType: ua.DataType.String, value });
    await call(session, "part", camera, [string("P1")]);
    await call(session, "empty", camera, [string("")]);
    await call(session, "too long", camera, [string("x".repeat(1000))]);
    await call(session, "int32", camera, [{ dataType: ua.DataType.Int32, value: 5 }]);
    await call(session, "none", camera, []);
    await call(session, "two", camera, [string("a"), string("b")]);
    await call(session, "other object", args.root, [string("P9")]);
    await until(() => sequences(changes).length >= 2, 15000, "a data change per verdict");
    await readAll(session, children, "after");
    const text = (value) => ({ dataType: ua.DataType.LocalizedText, value: new ua.LocalizedText({ text: value }) });
    const writes = [
        ["value", `${camera}.Verdict`, ua.AttributeIds.Value, string("OK")],
        ["display name", `${camera}.Verdict`, ua.AttributeIds.DisplayName, text("OK")],
        ["description", `${camera}.Verdict`, ua.AttributeIds.Description, text("OK")],
        ["camera's display name", camera, ua.AttributeIds.DisplayName, text("cam9")],
        ["executable", `${camera}.Verdict`, ua.AttributeIds.Executable, { dataType: ua.DataType.Boolean, value: true }],
        ["camera's value rank", camera, ua.AttributeIds.ValueRank, { dataType: ua.DataType.Int32, value: -1 }],
        ["unknown node", `${camera}.Nothing`, ua.AttributeIds.Value, string("OK")],
        ["unknown node's display name", `${camera}.Nothing`, ua.AttributeIds.DisplayName, text("OK")],
    ];
    for (const [label, nodeId, attributeId, value] of writes) {
        const written = await session.write({ nodeId, attributeId, value: { value } });
        emit("write", { label, status: written.name });
    }
    await subscription.terminate();
    await watching.close();
    await session.close();
    await watcher.disconnect();
    await reader.disconnect();
    emit("closed", {});
}

// What a user gets wrong against the anonymous server, then a good read: it still serves.
async function mistakes() {
    const user = { type: ua.UserTokenType.UserName, userName: "plc", password: "secret" };
    await attempt("wrong path", `${args.url}/wrong/path`, { endpointMustExist: true });
    await attempt("SignAndEncrypt", args.url, {
        securityMode: ua.MessageSecurityMode.SignAndEncrypt,
        securityPolicy: ua.SecurityPolicy.Basic256Sha256,
    });
    await attempt("user name", args.url, {}, user);
    await attempt("good", args.url, {});
}

// A session, with a subscription to `subscribe` unless empty, left open: the test kills this process.
// With `user`, signed in over Basic256Sha256 SignAndEncrypt, the server trusted in the PKI already.
async function linger() {
    const c = client(args.user ? SECURE : {});
    await c.connect(args.url);
    const session = await c.createSession(
        args.user ? { type: ua.UserTokenType.UserName, userName: args.user, password: args.password } : undefined
    );
    if (args.subscribe.length) await subscribe(session, args.subscribe);
    emit("ready", {});
    setInterval(() => {}, 1000);
}

// Basic256Sha256 SignAndEncrypt with a user: the server's certificate trusted as the docs say (its
// server.der in the client's trust list), then what a user gets wrong, then a subscription.
async function secured() {
    for (const url of args.urls) await endpoints(url);
    const user = { type: ua.UserTokenType.UserName, userName: args.user, password: args.password };
    await attempt("untrusted server", args.url, { ...SECURE, clientCertificateManager: certificates(args.untrusted_pki) }, user);
    const trusted = path.join(args.pki, "trusted", "certs");
    fs.mkdirSync(trusted, { recursive: true });
    fs.copyFileSync(args.server_der, path.join(trusted, "edged.der"));
    await attempt("None", args.url, { endpointMustExist: true }, user);
    await attempt("Sign", args.url, { securityMode: ua.MessageSecurityMode.Sign, securityPolicy: ua.SecurityPolicy.Basic256Sha256 }, user);
    await attempt("anonymous", args.url, SECURE);
    await attempt("wrong password", args.url, SECURE, { ...user, password: "not the password" });
    const c = client({ ...SECURE, endpointMustExist: true });
    await c.connect(args.url);
    const session = await c.createSession(user);
    const children = await browse(session);
    await readAll(session, children, "signed in");
    const { subscription, changes } = await subscribe(session, ["Sequence", "LastMessage"]);
    await until(() => sequences(changes).length >= args.changes, 20000, `${args.changes} verdicts`);
    await subscription.terminate();
    await session.close();
    await c.disconnect();
    emit("closed", {});
}

const scenarios = { anonymous, mistakes, linger, secured };
scenarios[args.scenario]().then(
    () => args.scenario === "linger" || process.exit(0),
    (e) => {
        emit("error", { message: String(e.stack || e) });
        process.exit(1);
    }
);
