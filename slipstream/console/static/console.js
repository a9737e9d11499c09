// slipstream console: copy buttons and the stream page's rate chart (uPlot). No build step.
"use strict";

document.addEventListener("click", (event) => {
  const button = event.target.closest("button.copy");
  if (!button) return;
  const text = button.dataset.copy;
  const done = () => { button.textContent = "Copied"; setTimeout(() => { button.textContent = "Copy StreamCut"; }, 1500); };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(text).then(done, () => fallbackCopy(text, done));
  } else {
    fallbackCopy(text, done);
  }
});

function fallbackCopy(text, done) {
  const area = document.createElement("textarea");
  area.value = text;
  document.body.appendChild(area);
  area.select();
  document.execCommand("copy");
  area.remove();
  done();
}

function rateChart(box) {
  const source = box.dataset.source;
  const options = {
    width: Math.min(box.clientWidth || 760, 1000), height: 200,
    series: [{}, { label: "produce /s", stroke: "#3c8dd6", width: 2 }, { label: "consume /s", stroke: "#2da44e", width: 2 }],
    axes: [{}, { size: 60 }],
  };
  let plot = null;
  const refresh = () => fetch(source).then((r) => r.json()).then((d) => {
    const data = [d.t, d.produce, d.consume];
    if (plot) plot.setData(data); else plot = new uPlot(options, data, box);
  }).catch(() => {});
  refresh();
  setInterval(refresh, 2000);
}

window.addEventListener("DOMContentLoaded", () => {
  const box = document.getElementById("rate-chart");
  if (box && window.uPlot) rateChart(box);
});
