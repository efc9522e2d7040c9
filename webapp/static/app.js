/* zoo's pages: the spectra chart of an adapter and the zoo map (Chart.js, served locally). */
"use strict";

/* The spectra chart's line colours, one per layer (the map's colours come with its data, from the server). */
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
  "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354"];

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

/* "#rrggbb" as [r, g, b]. */
function rgbOf(hex) {
  return [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
}

/* The colour at t (0..1) of a scale given as stops from low to high (the map resource's legend.colours: viridis). */
function scaleColour(t, stops) {
  const at = Math.min(Math.max(t, 0), 1) * (stops.length - 1), i = Math.min(Math.floor(at), stops.length - 2), f = at - i;
  const [a, b] = [rgbOf(stops[i]), rgbOf(stops[i + 1])];
  return `rgb(${a.map((v, k) => Math.round(v + (b[k] - v) * f)).join(", ")})`;
}

/* A number short enough for a label: four significant digits. */
function shortNumber(v) {
  return String(Number(v.toPrecision(4)));
}

/* The datasets of a map coloured by a label: a dataset per value in its legend colour (the server's palette,
   zoo/domain/palette.py, as in `zoo map --plot`), most common first; values sharing a colour (past the palette) as
   one "other"; points without a value last, drawn beneath. */
function labelDatasets(points, legend) {
  const uses = new Map();
  legend.values.forEach((v) => uses.set(v.colour, (uses.get(v.colour) || 0) + 1));
  const own = legend.values.filter((v) => uses.get(v.colour) === 1);
  const colourOf = new Map(own.map((v) => [v.value, v.colour]));
  const datasets = own.map((v) => ({ label: v.value, data: points.filter((p) => p.value === v.value), backgroundColor: v.colour, count: v.count }));
  const rest = points.filter((p) => p.value !== null && !colourOf.has(String(p.value)));
  if (rest.length) {
    const other = legend.values.find((v) => uses.get(v.colour) > 1);
    datasets.push({ label: `other (${legend.values.length - own.length} values)`, data: rest, backgroundColor: other.colour, count: rest.length });
  }
  return datasets;
}

/* The datasets of a map coloured by a metric: one, each point at its place on the scale. */
function metricDatasets(points, legend, colorBy) {
  const have = points.filter((p) => typeof p.value === "number");
  const span = legend.max > legend.min ? legend.max - legend.min : 1;
  const colours = have.map((p) => scaleColour((p.value - legend.min) / span, legend.colours));
  return have.length ? [{ label: colorBy, data: have, backgroundColor: colours, count: have.length, scale: true }] : [];
}

/* Draw the colour bar: the scale's stops from left (min) to right (max), with its ends labelled. */
function drawColourBar(legend) {
  const bar = document.getElementById("colour-bar");
  bar.width = Math.max(bar.clientWidth, 1) * (window.devicePixelRatio || 1);
  bar.height = Math.max(bar.clientHeight, 1) * (window.devicePixelRatio || 1);
  const ctx = bar.getContext("2d"), gradient = ctx.createLinearGradient(0, 0, bar.width, 0);
  legend.colours.forEach((c, i) => gradient.addColorStop(i / (legend.colours.length - 1), c));
  ctx.fillStyle = gradient;
  ctx.fillRect(0, 0, bar.width, bar.height);
  document.getElementById("scale-min").textContent = "min " + shortNumber(legend.min);
  document.getElementById("scale-max").textContent = "max " + shortNumber(legend.max);
}

/* The map's key beside (a phone: below) the plot, never on it: the colour bar of a metric, a swatch per dataset
   (click one to hide or show its points). */
function drawMapKey(chart, legend, colorBy) {
  const key = document.getElementById("map-key"), list = document.getElementById("map-legend");
  document.getElementById("map-key-title").textContent = colorBy || "";
  const scale = legend && legend.kind === "metric" && legend.min !== null;
  document.getElementById("colour-scale").hidden = !scale;
  list.replaceChildren();
  chart.data.datasets.forEach((d, i) => {
    if (d.scale) return;  // the colour bar stands for it
    const item = document.createElement("li"), button = document.createElement("button"), swatch = document.createElement("span");
    swatch.className = d.pointStyle === "star" ? "swatch star" : "swatch";
    swatch.style.backgroundColor = d.pointStyle === "star" ? "" : d.backgroundColor;
    button.type = "button";
    button.className = "key-item";
    button.setAttribute("aria-pressed", "true");
    button.append(swatch, " " + d.label + " ");
    if (d.count !== undefined) { const n = document.createElement("span"); n.className = "count"; n.textContent = String(d.count); button.append(n); }
    button.addEventListener("click", () => {
      const shown = !chart.isDatasetVisible(i);
      chart.setDatasetVisibility(i, shown);
      button.setAttribute("aria-pressed", String(shown));
      chart.update();
    });
    item.append(button);
    list.append(item);
  });
  key.hidden = !scale && !list.children.length;
  key.parentElement.classList.toggle("keyed", !key.hidden);
  if (scale) drawColourBar(legend);
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
  const legend = data.legend;
  let datasets = [{ label: "adapters", data: points, backgroundColor: "#1d77b6" }];
  if (legend) {
    datasets = legend.kind === "metric" ? metricDatasets(points, legend, colorBy) : labelDatasets(points, legend);
    const bare = points.filter((p) => p.value === null);
    if (bare.length) datasets.push({ label: "(no value)", data: bare, backgroundColor: legend.missing_colour, count: bare.length });
  }
  datasets.forEach((d) => { d.pointRadius = 3; });
  const marked = points.filter((p) => String(p.id) === String(highlight));
  if (marked.length) datasets.unshift({ label: "this adapter", data: marked, backgroundColor: "#000", pointRadius: 8, pointStyle: "star", borderColor: "#000" });
  info.textContent = `${data.count} adapters (${data.points.length} drawn), ${data.method} embedding, PCA. Click a point to open it.`;
  const canvas = document.getElementById("map");
  const chart = new Chart(canvas, {
    type: "scatter", data: { datasets },
    options: { maintainAspectRatio: false, animation: false,
      plugins: { tooltip: { callbacks: { label: (c) => c.raw.name + (c.raw.value !== null && c.raw.value !== undefined ? " — " + c.raw.value : "") } },
                 legend: { display: false } },
      onClick: (event, elements) => { if (elements.length) { const p = chart.data.datasets[elements[0].datasetIndex].data[elements[0].index]; window.location = "/adapters/" + p.id; } },
      scales: { x: { grace: "5%", ticks: { display: false }, title: { display: true, text: "PC 1" } },
                y: { grace: "5%", ticks: { display: false }, title: { display: true, text: "PC 2" } } } },
  });
  drawMapKey(chart, legend, colorBy);
  canvas.dataset.points = String(points.length);
  window.zooMapChart = chart;
}

/* A wide table scrolls sideways inside its wrapper (.scroll), never the page: while it is cut off, a line above it
   says so and its right edge fades (app.css), until it is scrolled to the end. */
function scrollHints() {
  document.querySelectorAll(".scroll").forEach((wrapper) => {
    const hint = document.createElement("p");
    hint.className = "scroll-hint";
    hint.textContent = "scroll sideways for more →";
    wrapper.before(hint);
    const mark = () => {
      const overflows = wrapper.scrollWidth > wrapper.clientWidth + 1;
      wrapper.classList.toggle("overflows", overflows);
      wrapper.classList.toggle("at-end", wrapper.scrollLeft + wrapper.clientWidth >= wrapper.scrollWidth - 1);
      hint.hidden = !overflows;
    };
    wrapper.addEventListener("scroll", mark, { passive: true });
    new ResizeObserver(mark).observe(wrapper);
    mark();
  });
}

/* The upload form's drop zone: files dropped on it become the file input's (which still opens a picker), and their
   names are listed. A file dropped elsewhere on the page is ignored rather than opened by the browser. */
function dropZone(zone) {
  const input = zone.querySelector("input[type=file]"), names = zone.querySelector(".drop-files");
  const list = () => { names.textContent = [...input.files].map((f) => f.name).join(", "); };
  const over = (e) => { e.preventDefault(); zone.classList.add("dragging"); };
  zone.addEventListener("dragenter", over);
  zone.addEventListener("dragover", over);
  zone.addEventListener("dragleave", (e) => { if (!zone.contains(e.relatedTarget)) zone.classList.remove("dragging"); });
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("dragging");
    if (e.dataTransfer && e.dataTransfer.files.length) { input.files = e.dataTransfer.files; list(); }
  });
  input.addEventListener("change", list);
  ["dragover", "drop"].forEach((t) => window.addEventListener(t, (e) => { if (!zone.contains(e.target)) e.preventDefault(); }));
}

/* What the pages' markup asks for, wired here: the Content-Security-Policy (webapp/security.py) runs no inline script
   or event handler, only this site's files. */
document.querySelectorAll("select[data-autosubmit]").forEach((s) => s.addEventListener("change", () => s.form.submit()));
const modulesData = document.getElementById("modules-data");
if (modulesData) zooSpectra(JSON.parse(modulesData.textContent));
const mapCanvas = document.getElementById("map");
if (mapCanvas && mapCanvas.dataset.url) zooMap(mapCanvas.dataset.url, JSON.parse(mapCanvas.dataset.colorBy), mapCanvas.dataset.highlight);
scrollHints();
const uploadZone = document.getElementById("drop-zone");
if (uploadZone) dropZone(uploadZone);
const facetFilters = document.getElementById("filters");  // open in the markup; on a phone closed, so results come first
if (facetFilters && window.matchMedia("(max-width: 720px)").matches) facetFilters.open = false;
const swaggerUi = document.getElementById("swagger-ui");
if (swaggerUi) SwaggerUIBundle({ url: swaggerUi.dataset.spec, dom_id: "#swagger-ui", deepLinking: true, defaultModelsExpandDepth: -1 });
