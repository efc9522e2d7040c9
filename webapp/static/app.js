/* zoo's pages: the spectra chart of an adapter and the zoo map (Chart.js, served locally). */
"use strict";

const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
  "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354"];

/* The i-th of n categorical colours: the palette while it lasts, else hues a golden angle apart at three
   lightnesses, so that no two of any number of groups share a colour. */
function categoryColour(i, n) {
  if (n <= PALETTE.length) return PALETTE[i];
  return `hsl(${Math.round((i * 137.508) % 360)}, 70%, ${[38, 52, 66][i % 3]}%)`;
}

function zooSpectra(modules) {
  const canvas = document.getElementById("spectra");
  const picker = document.getElementById("spectra-type");
  const types = [...new Set(modules.map((m) => m.module_type))].sort();
  types.forEach((t) => picker.add(new Option(t, t)));
  let chart = null;
  function draw() {
    const chosen = modules.filter((m) => m.module_type === picker.value && m.singular_values.length);
    const datasets = chosen.map((m, i) => ({
      label: m.layer_index === null ? m.name : "layer " + m.layer_index,
      data: m.singular_values.map((s, j) => ({ x: j + 1, y: s })),
      borderColor: PALETTE[i % PALETTE.length], backgroundColor: PALETTE[i % PALETTE.length], pointRadius: 2, showLine: true,
    }));
    if (chart) chart.destroy();
    chart = new Chart(canvas, {
      type: "scatter", data: { datasets },
      options: { maintainAspectRatio: false, animation: false,
        scales: { x: { title: { display: true, text: "component" }, ticks: { precision: 0 } },
                  y: { type: "logarithmic", title: { display: true, text: "singular value" } } } },
    });
    canvas.dataset.series = String(datasets.length);
  }
  picker.addEventListener("change", draw);
  if (types.length) draw();
}

function colourFor(value, lo, hi) {
  const t = hi > lo ? (value - lo) / (hi - lo) : 0.5;
  return `hsl(${Math.round(240 - 240 * t)}, 75%, 45%)`;
}

async function zooMap(url, colorBy, highlight) {
  const params = new URLSearchParams({ limit: "20000" });
  if (colorBy !== null) params.set("color_by", colorBy);  // null: the server's default (the task); "": none
  if (highlight) params.append("highlight", highlight);
  const info = document.getElementById("map-info");
  const response = await fetch(url + "?" + params);
  const data = await response.json();
  if (!response.ok) { info.textContent = data.error.message; return; }
  colorBy = data.color_by;  // what the map is coloured by: the task when none was asked for
  const picker = document.getElementById("color-by");
  (data.color_keys || []).forEach((k) => picker.add(new Option(k, k, false, k === colorBy)));
  const points = data.points.map((p) => ({ x: p.x, y: p.y, id: p.id, name: p.name, value: p.value }));
  const numeric = points.some((p) => typeof p.value === "number");
  let datasets;
  if (colorBy && !numeric) {
    const groups = new Map();
    points.forEach((p) => { const k = p.value === null ? "(none)" : String(p.value); (groups.get(k) || groups.set(k, []).get(k)).push(p); });
    const named = [...groups.entries()].filter(([k]) => k !== "(none)").sort();
    datasets = named.map(([k, ps], i) => ({ label: k, data: ps, backgroundColor: categoryColour(i, named.length), pointRadius: 3 }));
    if (groups.has("(none)")) datasets.push({ label: "(none)", data: groups.get("(none)"), backgroundColor: "#9aa5b1", pointRadius: 3 });
  } else {
    const values = points.map((p) => p.value).filter((v) => typeof v === "number");
    const lo = Math.min(...values), hi = Math.max(...values);
    datasets = [{ label: colorBy || "adapters", data: points, pointRadius: 3,
      backgroundColor: colorBy ? points.map((p) => (typeof p.value === "number" ? colourFor(p.value, lo, hi) : "#9aa5b1")) : PALETTE[0] }];
  }
  const marked = points.filter((p) => String(p.id) === String(highlight));
  if (marked.length) datasets.unshift({ label: "this adapter", data: marked, backgroundColor: "#000", pointRadius: 8, pointStyle: "star", borderColor: "#000" });
  info.textContent = `${data.count} adapters (${data.points.length} drawn), ${data.method} embedding, PCA. Click a point to open it.`;
  const canvas = document.getElementById("map");
  const chart = new Chart(canvas, {
    type: "scatter", data: { datasets },
    options: { maintainAspectRatio: false, animation: false,
      plugins: { tooltip: { callbacks: { label: (c) => c.raw.name + (c.raw.value !== null && c.raw.value !== undefined ? " — " + c.raw.value : "") } },
                 legend: { display: datasets.length > 1 } },
      onClick: (event, elements) => { if (elements.length) { const p = chart.data.datasets[elements[0].datasetIndex].data[elements[0].index]; window.location = "/adapters/" + p.id; } },
      scales: { x: { grace: "5%", ticks: { display: false }, title: { display: true, text: "PC 1" } },
                y: { grace: "5%", ticks: { display: false }, title: { display: true, text: "PC 2" } } } },
  });
  canvas.dataset.points = String(points.length);
  window.zooMapChart = chart;
}

/* What the pages' markup asks for, wired here: the Content-Security-Policy (webapp/security.py) runs no inline script
   or event handler, only this site's files. */
document.querySelectorAll("select[data-autosubmit]").forEach((s) => s.addEventListener("change", () => s.form.submit()));
const modulesData = document.getElementById("modules-data");
if (modulesData) zooSpectra(JSON.parse(modulesData.textContent));
const mapCanvas = document.getElementById("map");
if (mapCanvas && mapCanvas.dataset.url) zooMap(mapCanvas.dataset.url, JSON.parse(mapCanvas.dataset.colorBy), mapCanvas.dataset.highlight);
const swaggerUi = document.getElementById("swagger-ui");
if (swaggerUi) SwaggerUIBundle({ url: swaggerUi.dataset.spec, dom_id: "#swagger-ui", deepLinking: true, defaultModelsExpandDepth: -1 });
