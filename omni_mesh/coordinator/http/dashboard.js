"use strict";
// No CDN, nothing to install: the coordinator's own JSON, polled once a second. The page and this
// script hold no data and load without the API key; with one, open the page as /dashboard#key=KEY
// (a fragment is never sent to the server) or type the key into the form a 401 shows. The key stays
// in this page. Every value from the mesh is put in the page as text (textContent, setAttribute),
// never parsed as HTML: a replica id is whatever a mesh member registered.
let key = new URLSearchParams(location.hash.slice(1)).get("key");
const BOX_W = 190, BOX_H = 96, GAP_X = 170, GAP_Y = 28;
let previous = null;

async function fetchJson(path) {
  const response = await fetch(path, {headers: key ? {Authorization: "Bearer " + key} : {}});
  if (response.status === 401) document.getElementById("keyform").hidden = false;
  if (!response.ok) throw new Error(path + ": HTTP " + response.status);
  return response.json();
}

function useKey(event) {
  event.preventDefault();
  key = document.getElementById("key").value || null;
  document.getElementById("keyform").hidden = true;
  tick();
}

function cells(tag, values, attrs) {
  // One table row of text cells.
  const row = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) row.setAttribute(k, v);
  for (const value of values) {
    const cell = document.createElement("td");
    cell.textContent = value;
    row.append(cell);
  }
  return row;
}

function el(name, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", name);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function layout(topology) {
  // Columns by longest path from an entry stage: data flows left to right.
  const level = {}, ids = topology.stages.map(s => s.id);
  ids.forEach(id => level[id] = 0);
  for (let round = 0; round < ids.length; round++)
    for (const e of topology.edges) level[e.to] = Math.max(level[e.to], level[e.from] + 1);
  const columns = {};
  for (const s of topology.stages) (columns[level[s.id]] = columns[level[s.id]] || []).push(s);
  const pos = {};
  for (const [col, stages] of Object.entries(columns))
    stages.forEach((s, row) => pos[s.id] = {x: 20 + col * (BOX_W + GAP_X), y: 20 + row * (BOX_H + GAP_Y)});
  return pos;
}

function rate(now, before, seconds) {
  return before === undefined || seconds <= 0 ? 0 : Math.max(0, (now - before) / seconds);
}

function render(topology, stats, seconds) {
  const svg = document.getElementById("graph");
  svg.querySelectorAll("g").forEach(g => g.remove());
  const pos = layout(topology);
  const names = Object.fromEntries(topology.stages.map(s => [s.id, s.name]));
  const width = Math.max(...Object.values(pos).map(p => p.x)) + BOX_W + 30;
  const height = Math.max(...Object.values(pos).map(p => p.y)) + BOX_H + 30;
  svg.setAttribute("width", width); svg.setAttribute("height", height);
  for (const e of topology.edges) {
    const a = pos[e.from], b = pos[e.to], label = names[e.from] + "->" + names[e.to];
    const edge = stats.edges[label] || {bytes: 0};
    const bps = rate(edge.bytes, previous && previous.edges[label] && previous.edges[label].bytes, seconds);
    const g = el("g", {class: "edge", "data-edge": label});
    const x1 = a.x + BOX_W, y1 = a.y + BOX_H / 2, x2 = b.x - 4, y2 = b.y + BOX_H / 2;
    g.append(el("line", {x1, y1, x2, y2}));
    g.append(el("text", {x: (x1 + x2) / 2, y: (y1 + y2) / 2 - 8, "text-anchor": "middle"}, e.connector_name));
    g.append(el("text", {x: (x1 + x2) / 2, y: (y1 + y2) / 2 + 16, "text-anchor": "middle"}, human(bps) + "/s"));
    svg.append(g);
  }
  for (const s of topology.stages) {
    const st = stats.stages[s.name], p = pos[s.id];
    const healthy = st.replicas.filter(r => r.health === "healthy").length;
    const g = el("g", {class: "stage" + (healthy ? "" : " unhealthy"), "data-stage": s.name,
                       transform: `translate(${p.x},${p.y})`});
    g.append(el("rect", {width: BOX_W, height: BOX_H}));
    g.append(el("text", {x: 10, y: 20, class: "name"}, s.name));
    const rps = rate(st.processed, previous && previous.stages[s.name] && previous.stages[s.name].processed, seconds);
    const scale = s.autoscale ? ` · ${st.current_replicas}→${st.target_replicas} replicas` : "";
    g.append(el("text", {x: 10, y: 40, "data-target": st.target_replicas}, `${st.inflight} in flight · ${st.queued} queued${scale}`));
    g.append(el("text", {x: 10, y: 58}, `${rps.toFixed(1)} req/s · ${ms(st.mean_service_s)}`));
    st.replicas.forEach((r, i) => {
      g.append(el("circle", {cx: 16 + i * 16, cy: 78, r: 6, class: r.health, "data-replica": r.id},));
      g.lastChild.append(el("title", {}, `${r.id}: ${r.health}, ${r.inflight} in flight`));
    });
    svg.append(g);
  }
  document.querySelector("#stages tbody").replaceChildren(...topology.stages.map(s => {
    const st = stats.stages[s.name];
    const rps = rate(st.processed, previous && previous.stages[s.name] && previous.stages[s.name].processed, seconds);
    const healthy = st.replicas.filter(r => r.health === "healthy").length;
    const target = s.autoscale ? `${st.current_replicas} → ${st.target_replicas} (${s.autoscale.min_replicas}-${s.autoscale.max_replicas})`
                               : `${st.target_replicas}`;
    return cells("tr", [s.name, st.replicas.map(r => r.id).join(", "), `${healthy}/${st.replicas.length}`, target,
                        st.inflight, st.queued, rps.toFixed(1), ms(st.mean_service_s), st.errors, ...engine(st.engine)],
                 {"data-stage": s.name});
  }));
  document.querySelector("#edges tbody").replaceChildren(...topology.edges.map(e => {
    const label = names[e.from] + "->" + names[e.to], edge = stats.edges[label] || {bytes: 0};
    const bps = rate(edge.bytes, previous && previous.edges[label] && previous.edges[label].bytes, seconds);
    return cells("tr", [label, e.connector_name, human(bps) + "/s", human(edge.bytes)]);
  }));
  const done = stats.requests.completed + stats.requests.failed;
  const before = previous ? previous.requests.completed + previous.requests.failed : undefined;
  document.getElementById("rps").textContent = rate(done, before, seconds).toFixed(1);
  document.getElementById("completed").textContent = stats.requests.completed;
  document.getElementById("failed").textContent = stats.requests.failed;
  document.getElementById("inflight").textContent = stats.requests.inflight;
}

function engine(figures) {
  // A model stage's running batch (of its max), the requests waiting to join it, its KV cache in use (of
  // the budget) and tokens (a talker: codes) per second; "-" for a stage that reports none of them.
  const f = figures || {}, or = (v, text) => v === undefined ? "-" : text;
  const kv = f.kv_cache_budget_tokens !== undefined
    ? `${f.kv_cache_used_tokens || 0} / ${f.kv_cache_budget_tokens} tok (${pct(f.kv_cache_used_tokens, f.kv_cache_budget_tokens)})`
    : or(f.kv_cache_used_tokens, `${f.kv_cache_used_tokens} tok`);
  const perSecond = f.generated_tokens_per_second !== undefined ? f.generated_tokens_per_second : f.generated_codes_per_second;
  return [or(f.batch_running, `${f.batch_running} / ${f.batch_max}`), or(f.batch_queued, `${f.batch_queued}`), kv,
          or(perSecond, Number(perSecond).toFixed(1))];
}

function pct(used, budget) { return budget ? Math.round(100 * (used || 0) / budget) + "%" : "-"; }

function human(bytes) {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (bytes >= 1024 && i < units.length - 1) { bytes /= 1024; i++; }
  return bytes.toFixed(i ? 1 : 0) + " " + units[i];
}

function ms(seconds) { return seconds == null ? "-" : (seconds * 1000).toFixed(1) + " ms"; }

async function tick() {
  try {
    const [topology, stats] = await Promise.all([fetchJson("/v1/topology"), fetchJson("/v1/stats")]);
    const now = performance.now();
    document.getElementById("title").textContent = "omni-mesh · " + topology.name;
    render(topology, stats, previous ? (now - previous.at) / 1000 : 0);
    previous = Object.assign(stats, {at: now});
    document.getElementById("status").textContent = "live · " + new Date().toLocaleTimeString();
  } catch (error) {
    document.getElementById("status").textContent = "no answer: " + error.message;
  }
}
addEventListener("hashchange", () => { key = new URLSearchParams(location.hash.slice(1)).get("key") || key; tick(); });
document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("keyform").addEventListener("submit", useKey);
  tick();
  setInterval(tick, 1000);
});
